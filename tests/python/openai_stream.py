"""Streams one chat completion from sparkd with the official `openai` client and checks what it sees.

Usage: python3 openai_stream.py BASE_URL MODEL
Exits non-zero with a message on any mismatch; prints a JSON summary on success.
"""
import json
import sys

import openai


def main() -> int:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello from the openai client"}],
        stream=True,
        max_completion_tokens=10,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage, chunks = "", None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            delta = chunk.choices[0].delta
            text += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        print("no usage chunk", file=sys.stderr)
        return 1
    if usage.completion_tokens != 10:
        print(f"completion_tokens {usage.completion_tokens} != 10", file=sys.stderr)
        return 1
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    if cached is None:
        print("no prompt_tokens_details.cached_tokens", file=sys.stderr)
        return 1
    if finish != "length" or not text:
        print(f"finish {finish!r}, text {text!r}", file=sys.stderr)
        return 1
    models = [m.id for m in client.models.list()]
    if model not in models:
        print(f"{model} not in {models}", file=sys.stderr)
        return 1
    print(json.dumps({"chunks": chunks, "text": text, "prompt_tokens": usage.prompt_tokens, "cached": cached}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
