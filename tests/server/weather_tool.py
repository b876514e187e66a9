"""The weather tool that the tool-calling tests offer Qwen2.5-Coder-0.5B, in each API's shape,
and the question that makes it call the tool."""

from __future__ import annotations

NAME = "get_weather"
DESCRIPTION = "Get the current weather in a city"
# a city and a unit, both required, nothing else
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# a city only
CITY_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK_WEATHER = "What is the weather like in Paris right now?"


def chat_tool(parameters: dict = PARAMETERS) -> dict:
    """OpenAI chat completions' and Ollama's shape."""
    return {
        "type": "function",
        "function": {"name": NAME, "description": DESCRIPTION, "parameters": parameters},
    }


def flat_tool(parameters: dict = PARAMETERS) -> dict:
    """OpenAI Responses' shape."""
    return {"type": "function", "name": NAME, "description": DESCRIPTION, "parameters": parameters}


def anthropic_tool(parameters: dict = PARAMETERS) -> dict:
    return {"name": NAME, "description": DESCRIPTION, "input_schema": parameters}
