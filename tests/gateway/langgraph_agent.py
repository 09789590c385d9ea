"""The calculator agent of sdk_agent.py written with LangGraph: the ReAct loop as a graph (a model node, a
`ToolNode`, `tools_condition` between them) over LangChain's `ChatOpenAI`, pointed at an OpenAI-compatible
server by its base URL and key.

Run as a command (the task as a JSON line on stdin, OPENAI_BASE_URL and OPENAI_API_KEY from the
environment) or as a function (`run`). LangSmith tracing is off unless LANGSMITH_TRACING is set; it is not.
"""

from __future__ import annotations

import json
import os
import sys

from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from tests.gateway.sdk_agent import CALCULATOR, calculate

# the same schema as sdk_agent's: a JSON schema as args_schema is sent as it is
calculator = StructuredTool.from_function(
    func=calculate,
    name=CALCULATOR["function"]["name"],
    description=CALCULATOR["function"]["description"],
    args_schema=CALCULATOR["function"]["parameters"],
)


def run(task: dict, base_url: str | None = None, api_key: str | None = None) -> str:
    """The agent's answer to the task's question (None: OPENAI_BASE_URL and OPENAI_API_KEY)."""
    llm = ChatOpenAI(
        model="gpt-4o-mini",
        base_url=base_url or os.environ["OPENAI_BASE_URL"],
        api_key=api_key or os.environ["OPENAI_API_KEY"],
        max_retries=0,
    ).bind_tools([calculator])

    def agent(state: MessagesState) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)  # a tool call -> "tools", else the end
    graph.add_edge("tools", "agent")
    final = graph.compile().invoke({"messages": [("user", task["question"])]}, {"recursion_limit": 8})
    return final["messages"][-1].content


if __name__ == "__main__":
    print(run(json.loads(sys.stdin.readline())))
