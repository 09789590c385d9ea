"""The OpenAI wire protocol of agent-r1's servers, in one place for `agent-r1 serve` and the gateway:

- `schema.py`: request bodies (pydantic, where bad input is caught and named) and `APIError`;
- `messages.py`: OpenAI messages and tools <-> the model family's tool-call format `ToolEnv` trains with;
- `bodies.py`: response bodies: chat.completion, its choices, chat.completion.chunk events, usage, models;
- `http.py`: error bodies for every failure, the request-size limit, server-sent events.
"""
