"""Load generation and reporting for OpenAI-compatible servers (`pdserve bench`)."""
