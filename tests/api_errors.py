"""The OpenAI-style error body every 4xx carries, checked once for the tests that read one."""

import httpx


def openai_error(r: httpx.Response, status: int) -> dict:
    """The response's `error` object, after checking the status and the object's four fields."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err
