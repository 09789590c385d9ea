"""The OpenAI (and Anthropic) wire protocols of agent-r1's servers, in one place for `agent-r1 serve` and the gateway:

- `schema.py`: request bodies (pydantic, where bad input is caught and named) and `APIError`;
- `messages.py`: OpenAI messages and tools <-> the model family's tool-call format `ToolEnv` trains with;
- `bodies.py`: response bodies: chat.completion, its choices, chat.completion.chunk events, usage, models;
- `anthropic.py`, `responses.py`: Anthropic Messages and OpenAI Responses as faces of the same chat pipeline
  (a request becomes the chat request it means, the chat answer becomes their Message / Response and events);
- `http.py`: error bodies for every failure (in the route's protocol), the request-size limit, server-sent events.
"""
