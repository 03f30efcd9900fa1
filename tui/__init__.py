"""The Textual chat app (an OpenAI-API client). Built in the chat issue; nothing here yet."""
