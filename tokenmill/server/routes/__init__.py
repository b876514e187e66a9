"""The server's endpoints, one FastAPI router per family, wired together by `build_app`."""
