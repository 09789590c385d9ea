"""The gateway: an agent program written against the OpenAI API, trained as it is.

Point its `OPENAI_BASE_URL` at the gateway and it becomes an agent-r1 environment (`ProgramEnv`): each
chat request is a step whose prompt ids the policy samples from, token-exact across turns
(docs/agents.md).
"""

from agent_r1.gateway.env import Episode, ProgramEnv, ProgramEnvFactory, ProgramError, ProgramOutput
from agent_r1.gateway.server import gateway

__all__ = ["Episode", "ProgramEnv", "ProgramEnvFactory", "ProgramError", "ProgramOutput", "gateway"]
