"""Constants shared by tests/chat (a module name of its own: ``conftest`` is ambiguous across
test directories)."""
TOKEN = "chat-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
