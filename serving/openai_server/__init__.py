"""dsv3-serve: an OpenAI-compatible server on the executor (protocol: request/response shapes; chat: the chat
template; app: the routes; cli: the command)."""
