"""The tool-using agent program the tool tests run: ask, call, run the Python function, feed
the result back, answer."""

from __future__ import annotations

from typing import Literal

from splitserve import lang


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """The current weather in a city.

    Args:
        city: the city's name, e.g. Paris.
        unit: the temperature unit.
    """
    return f"18 degrees {unit} and sunny in {city}"


def get_time(city: str) -> str:
    """The local time in a city.

    Args:
        city: the city's name.
    """
    return f"It is 10:30 in {city}"


TOOLS = [get_weather, get_time]


@lang.function
def weather_agent(s, question: str, tool_choice="get_weather", parallel=None):
    s += lang.system("You are a weather assistant. Use the tools to answer.")
    s += lang.user(question)
    s += lang.assistant(lang.gen("call", tools=TOOLS, tool_choice=tool_choice,
                                 parallel_tool_calls=parallel, max_tokens=48))
    for call in s.tool_calls("call"):
        s += lang.tool(call.invoke(TOOLS), call)
    s += lang.assistant(lang.gen("answer", max_tokens=16))
