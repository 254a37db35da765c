"""A client of `kvstore serve`, with nothing but the `openai` package: a conversation that lives on
the server as a stored session.

    kvstore serve &                                    # http://127.0.0.1:8000
    python examples/serve_client.py                    # or --base-url URL --api-key KEY --model NAME

It names its session with the X-Session-Id header, asks two questions (the second streamed), and
shows what the server did: the first turn computed its prompt, the second reused the session's KV
and computed only the new message. Then it reads the session back from /v1/sessions.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

import openai


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("KVSTORE_URL", "http://127.0.0.1:8000") + "/v1")
    parser.add_argument("--api-key", default=os.environ.get("KVSTORE_API_KEY", "none"),
                        help="one of the server's keys (any text when it has none)")
    parser.add_argument("--model", help="the served model (default: the server's first)")
    parser.add_argument("--session", default=f"example-{uuid.uuid4().hex[:8]}", help="the session's name")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2)
    model = args.model or client.models.list().data[0].id
    on_session = {"X-Session-Id": args.session}
    messages = [{"role": "user", "content": "Name three uses of a hash table."}]

    first = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, seed=1,
                                           extra_headers=on_session)
    reply = first.choices[0].message.content
    print(f"session {args.session}, turn 1 ({first.model}):\n{reply}")
    print(f"  prompt {first.usage.prompt_tokens} tokens, {first.usage.prompt_tokens_details.cached_tokens} "
          f"of them reused; {first.usage.completion_tokens} generated")

    # turn 2: the whole history, as with any OpenAI server; this one feeds only the new message
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Which is the fastest?"}]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, seed=1,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_headers=on_session)
    print("turn 2 (streamed):")
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    print(f"\n  prompt {usage.prompt_tokens} tokens, {usage.prompt_tokens_details.cached_tokens} of them reused "
          f"from the stored session; {usage.completion_tokens} generated")

    # the session as the server stores it (kvstore's own endpoint, through the same client)
    info = client.get(f"/sessions/{args.session}", cast_to=object)
    history = client.get(f"/sessions/{args.session}/messages", cast_to=object)["data"]
    print(f"stored: {info['n_tokens']} tokens, {len(history)} messages, {info['checkpoints']} checkpoints, "
          f"{info['disk_bytes']:,} bytes on disk")
    ok = usage.prompt_tokens_details.cached_tokens > 0 and [m["role"] for m in history] == \
        ["user", "assistant", "user", "assistant"]
    print("turn 2 reused turn 1's KV" if ok else "turn 2 did not reuse the session: is this kvstore serve?")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
