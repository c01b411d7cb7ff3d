"""Tool calls through the official `openai` client against sparkd: a non-streamed and a streamed call (with
`tool_choice: required`, so that the test model must call) each parse into `tool_calls` with valid JSON arguments,
and a two-turn tool loop (call, `role: tool` result, answer) runs over chat completions and over the Responses API
with `previous_response_id`.

Usage: python3 openai_tools.py BASE_URL MODEL
Exits non-zero with a message on any mismatch; prints a JSON summary on success.
"""
import json
import sys

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                       "required": ["city"], "additionalProperties": False},
    },
}]


def check_args(arguments: str) -> dict:
    args = json.loads(arguments)
    if not isinstance(args.get("city"), str):
        raise SystemExit(f"arguments without a city: {arguments}")
    return args


def main() -> int:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]

    whole = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           max_completion_tokens=120, temperature=0)
    choice = whole.choices[0]
    if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
        raise SystemExit(f"no tool call: {whole}")
    call = choice.message.tool_calls[0]
    check_args(call.function.arguments)

    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                            max_completion_tokens=120, temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.id or entry["id"]
            if d.function is not None:
                entry["name"] = d.function.name or entry["name"]
                entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    if finish != "tool_calls" or calls[0]["id"] != call.id or calls[0]["arguments"] != call.function.arguments:
        raise SystemExit(f"the streamed call differs: {calls} vs {call}")

    # The loop: the call and its result go back, and the model answers (no tools forced now).
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"weather": "snow"}'}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_completion_tokens=8,
                                            temperature=0)
    if answer.choices[0].message.content is None:
        raise SystemExit(f"no answer after the tool result: {answer}")

    # Responses: the call as a function_call item, its output by previous_response_id.
    first = client.responses.create(model=model, input="What is the weather in Oslo?", tool_choice="required",
                                    tools=[{"type": "function", **TOOLS[0]["function"]}], max_output_tokens=120,
                                    temperature=0)
    fc = [item for item in first.output if item.type == "function_call"]
    if not fc:
        raise SystemExit(f"no function_call item: {first}")
    check_args(fc[0].arguments)
    second = client.responses.create(model=model, previous_response_id=first.id, max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": fc[0].call_id,
                                             "output": '{"weather": "snow"}'}])
    if second.status not in ("completed", "incomplete") or not second.output:
        raise SystemExit(f"no continuation: {second}")
    print(json.dumps({"call": call.function.name, "arguments": call.function.arguments,
                      "responses_call": fc[0].name, "continued": second.id}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
