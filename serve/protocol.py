"""The request bodies as data: pydantic models that mirror OpenAI's, checked in one place.

Unknown fields are refused (a typo must not be silently ignored); fields OpenAI defines that
kvstore does not implement are refused with a message that says so (`UNSUPPORTED`), unless they
ask for nothing (null, false, empty: as OpenAI's own SDK objects carry them when a client sends one
back, an assistant message with `"tool_calls": null`, say) or for what happens anyway
(`ASKS_FOR_THE_DEFAULT`: plain text, no truncation, no tool to call, as SDKs send by default);
fields with no effect here that clients send by habit are accepted (`user`, `metadata`, an output
text's `annotations`, ...). Every refusal becomes a 400 in OpenAI's error shape (`app.py`), with
`param` naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

import kvstore
from kvstore import errors

from . import tools

TOOLS_WHERE = "tool calls are supported on chat completions and responses"
# fields of OpenAI's API that kvstore does not implement: refused, by name, with this reason
UNSUPPORTED = {
    # (where a request does not take them: completions; a message of the Responses API)
    "tools": TOOLS_WHERE, "tool_choice": TOOLS_WHERE, "parallel_tool_calls": TOOLS_WHERE,
    "tool_calls": "a message's tool_calls are chat's (the Responses API's calls are function_call items)",
    "functions": "the legacy function calls are not supported (use tools)",
    "function_call": "the legacy function calls are not supported (use tools)",
    "logprobs": "logprobs are not supported here", "top_logprobs": "logprobs are not supported here",
    "logit_bias": "logit_bias is not supported",
    "audio": "audio is not supported", "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "best_of": "best_of is not supported", "suffix": "suffix is not supported",
    "echo": "echo is the completions API's", "reasoning_effort": "reasoning options are not supported",
    "reasoning": "reasoning options are not supported", "text": "text is the Responses API's: chat and completions "
    "take response_format",
    "include": "include is not supported here", "background": "background responses are not supported",
    "truncation": "truncation is not supported", "prompt": "prompt templates are not supported",
}
# values of those fields that ask for what this server does anyway (plain text, no tools, no truncation:
# a prompt beyond the context is refused), as SDKs send them by default: accepted as if not sent
ASKS_FOR_THE_DEFAULT = {
    "modalities": lambda v: v == ["text"],
    "truncation": lambda v: v == "disabled",
    "tool_choice": lambda v: v in ("none", "auto"),  # with no tools there is nothing to call
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "reasoning": lambda v: isinstance(v, dict) and all(x is None for x in v.values()),
}
MAX_STOPS = 4
MAX_TOOLS = 128  # tools one chat request may give, as OpenAI bounds them
SAMPLER_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI bounds it
MAX_COMPLETION_LOGPROBS = 5  # the completions API's logprobs (alternatives per token), as OpenAI bounds it
# n: the choices one request may ask for, each generated in a session of its own (routes/answers.py)
MAX_CHOICES = 16
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # what a response's `include` names to get them
# what else OpenAI's Responses API may be asked to include: output this server never makes (tool
# calls, images, reasoning), so there is nothing to include and the request is answered as is
NOTHING_TO_INCLUDE = {"code_interpreter_call.outputs", "computer_call_output.output.image_url",
                      "file_search_call.results", "message.input_image.image_url", "reasoning.encrypted_content",
                      "web_search_call.action.sources"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        asked = {}
        for name, value in data.items():
            if name in UNSUPPORTED and name not in cls.model_fields:
                default = ASKS_FOR_THE_DEFAULT.get(name)
                if value is None or value is False or value in ([], {}) or (default is not None and default(value)):
                    continue  # asks for nothing, or for what happens anyway: as if it were not sent
                raise ValueError(f"unsupported:{name}:{UNSUPPORTED[name]}")
            asked[name] = value
        return asked


TextType = Literal["text", "input_text", "output_text"]  # a content part's types that hold text


class TextPart(Strict):
    type: TextType
    text: str
    annotations: list[Any] | None = None  # an output text sent back: no effect on the text
    logprobs: list[Any] | None = None


def joined(content: str | list[TextPart]) -> str:
    """A content's text: the string, or its parts' texts in order."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def text_parts_only(v: Any) -> Any:
    """A content list's parts other than text (images, audio, files) are refused, saying so."""
    if isinstance(v, list):
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind not in get_args(TextType):
                raise ValueError(f"unsupported:content:only text is supported (this server's model reads text), "
                                 f"not a {kind!r} part")
    return v


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as a reply gave it


class ToolCall(Strict):
    """A tool call of an assistant message, as a reply gave it and the client sends it back."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message without text (its refusal, else "")
    name: str | None = None
    refusal: str | None = None  # an assistant message sent back as OpenAI's SDK made it
    annotations: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message that called tools (serve/tools.py)
    tool_call_id: str | None = None  # a tool message: the call whose result it is

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        return text_parts_only(v)

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message (and only one) names the call it answers: tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        return joined(self.content)

    def plain(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class JsonSchema(Strict):
    """OpenAI's response_format json_schema: the schema, with its name and description (which only
    label it here). Generation is always held to the schema (`strict` asks for nothing more)."""
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None


class FormatBase(Strict):
    """What OpenAI's response formats share, and kvstore's regex (`pattern`: the whole reply matches
    it); checked here as the library checks a response format (`kvstore.check_response_format`).
    Subclasses say where a json_schema's schema is (`given_schema`)."""
    type: Literal["text", "json_object", "json_schema", "regex"]
    pattern: str | None = None

    def given_schema(self) -> dict[str, Any] | None:
        raise NotImplementedError

    @model_validator(mode="after")
    def _complete(self):
        if (self.type == "regex") != (self.pattern is not None):
            raise ValueError("pattern goes with type regex (and that type needs it)")
        try:
            kvstore.check_response_format(self.library())
        except errors.InvalidArgument as e:
            raise ValueError(str(e).removeprefix("bad response_format").lstrip(" :")) from None
        return self

    def library(self) -> dict[str, Any] | None:
        """The library's response_format (None: free text; a json_schema without its schema: any object)."""
        if self.type == "text":
            return None
        if self.type == "regex":
            return {"type": "regex", "pattern": self.pattern}
        if self.type == "json_schema" and self.given_schema() is not None:
            return {"type": "json_schema", "schema": self.given_schema()}
        return {"type": "json_object"}


class ResponseFormat(FormatBase):
    """Chat's and completions' response_format: OpenAI's text, json_object or json_schema (the schema
    in `json_schema`), and kvstore's regex."""
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_where_typed(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema (and that type needs it)")
        return self

    def given_schema(self) -> dict[str, Any] | None:
        return self.json_schema.schema_ if self.json_schema is not None else None


class TextFormat(FormatBase):
    """The Responses API's `text.format`: OpenAI's text, json_object and json_schema (its name, schema
    and strict at this level), and kvstore's regex."""
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_where_typed(self):
        if self.type != "json_schema" and (self.schema_, self.name, self.strict) != (None, None, None):
            raise ValueError("name, schema and strict go with type json_schema")
        return self

    def given_schema(self) -> dict[str, Any] | None:
        return self.schema_

    def shown(self) -> dict[str, Any]:
        """As a response object echoes it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: None = None  # a model's length hint (OpenAI's GPT-5): none here, so only null is taken


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # the openai client may send it; no effect here


class Sampling(Strict):
    """What every generating request shares."""
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    top_k: int | None = Field(None, ge=0)  # vLLM's and llama.cpp's extensions, the library's settings
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> added to its logit
    response_format: ResponseFormat | None = None  # this request's reply only (a session does not keep it)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    session: str | None = None  # kvstore: the stored session to continue (or the X-Session-Id header)
    kvstore_trace: bool = False  # kvstore: each token's position, id and logits hash in the reply

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        """The library's check (ids, range, count); the ids beyond the model's vocabulary are refused
        where the model is known, before the session records the setting."""
        try:
            kvstore.SamplerSettings(logit_bias=v or {})
        except errors.InvalidArgument as e:
            raise ValueError(str(e).removeprefix("bad sampler setting: ")) from None
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        return stops

    def alternatives(self) -> int | None:
        """None, or how many likeliest tokens each generated token's logprobs list (0: its own only)."""
        return None

    def scores_prompt(self) -> bool:
        """Whether every prompt token gets its logprobs entry (computed in its request's own prefill:
        a stored prefix's KV has no logits to give them)."""
        return False

    def format(self) -> dict[str, Any] | None:
        """The reply's response format as the library takes it (None: free text)."""
        return self.response_format.library() if self.response_format is not None else None

    def sampler(self) -> dict[str, float]:
        """The sampler settings the request gives (kvstore.SamplerSettings' names); a session keeps
        those it is not given."""
        out: dict[str, Any] = {name: float(v) for name in SAMPLER_FLOATS if (v := getattr(self, name)) is not None}
        if self.top_k is not None:
            out["top_k"] = int(self.top_k)
        if self.logit_bias is not None:  # ({}: none, in place of the session's)
            out["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return out


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments (none: any JSON object)
    strict: bool | None = None  # the arguments are always held to the schema here


def check_parameters(functions: list[FunctionDef]) -> None:
    """Each function's parameters, as the reply's format holds them (`tools.parameters`); two functions
    of one name are refused."""
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise ValueError("two tools have the same name")
    for f in functions:
        try:
            kvstore.check_response_format({"type": "json_schema", "schema": tools.parameters(f)})
        except errors.InvalidArgument as e:
            raise ValueError(f"the parameters of {f.name!r} are not a JSON schema this server can "
                             f"hold a reply to ({str(e).removeprefix('bad response_format').lstrip(' :')})") from None


def check_tool_choice(choice, names: list[str], fmt, format_field: str) -> None:
    """A tool_choice against the request's tool names (`choice.named()`: the one a named choice calls)
    and its own response format `fmt` (named `format_field`): with tools, the reply's format is theirs."""
    if choice is not None and not isinstance(choice, str) and choice.named() not in names:
        raise ValueError(f"it names {choice.named()!r}, which is not one of the tools")
    if choice not in (None, "none", "auto") and not names:
        raise ValueError("it asks for a tool call, but the request gives no tools")
    if names and fmt is not None and fmt.type != "text":
        raise ValueError(f"with tools the reply's format is theirs: give tools or {format_field}, not both")


def tools_format(functions: list[FunctionDef], choice, parallel: bool | None) -> dict[str, Any]:
    """The reply format of a request with tools (`tools.reply_format`): a named choice requires a call of it."""
    choice = choice or "auto"
    named = None if isinstance(choice, str) else choice.named()
    return tools.reply_format(functions, "required" if named else choice, parallel is not False, only=named)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction

    def named(self) -> str:
        return self.function.name


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    # after tools (its check reads them), checked when not given too (it checks response_format against tools)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, v):
        check_parameters([t.function for t in v or ()])
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v, info):
        check_tool_choice(v, [t.function.name for t in info.data.get("tools") or ()], info.data.get("response_format"),
                          "a response_format")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def format(self) -> dict[str, Any] | None:
        if self.tools:
            return tools_format([t.function for t in self.tools], self.tool_choice, self.parallel_tool_calls)
        return super().format()

    def plain_messages(self) -> list[dict[str, str]]:
        """The conversation as the session holds it (tool calls and results as text: serve/tools.py)."""
        return tools.messages(self)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]  # text, or token ids as they are
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False  # the reply begins with the prompt (with logprobs: every prompt token's entry too)

    def alternatives(self) -> int | None:
        return self.logprobs

    def scores_prompt(self) -> bool:
        return self.echo and self.logprobs is not None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        """A prompt: a string, or a list of token ids (taken as they are, no BOS added); or a list of
        prompts (a list of one of them is that one), each answered as a request of its own would be."""
        if v == [] or (isinstance(v, list) and any(p in ("", []) for p in v)):
            raise ValueError("an empty prompt: give text, or token ids")
        if isinstance(v, list) and all(isinstance(x, int) for x in v):
            return v
        if isinstance(v, list) and len(v) == 1:
            return v[0]
        return v

    @model_validator(mode="after")
    def _sessions_bounded(self):
        if len(self.prompts()) * (self.n or 1) > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n {self.n} choices: each runs in a session of its "
                             f"own, and a request may ask for {MAX_CHOICES} at most")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one, unless it gave a list of them)."""
        one = isinstance(self.prompt, str) or all(isinstance(x, int) for x in self.prompt)
        return [self.prompt] if one else list(self.prompt)

    def limit(self) -> int | None:
        return self.max_tokens


class InputMessage(Strict):
    """An input item of the Responses and Conversations APIs: a message (text only)."""
    type: Literal["message"] | None = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    id: str | None = None  # an item read back from a conversation, resent as is
    status: str | None = None
    phase: str | None = None  # (OpenAI's output items carry it)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        return text_parts_only(v)

    def plain(self) -> dict[str, str]:
        text = joined(self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class FunctionCallItem(Strict):
    """A function call of a response, sent back as input (an output item, as the client got it)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the reply gave it
    id: str | None = None
    status: str | None = None
    namespace: str | None = None  # (fields of OpenAI's output items, as SDKs send them back: no effect here)
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(None, alias="async")


class FunctionCallOutputItem(Strict):
    """A function's result, as input: the call it answers and its output (text)."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    name: str | None = None  # (as SDKs may send them: no effect here)
    namespace: str | None = None
    caller: dict[str, Any] | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, v):
        return text_parts_only(v)

    def text(self) -> str:
        return joined(self.output)


ITEM_TYPES = {"message": InputMessage, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


def item_type(v: Any) -> str | None:
    """Which kind of input item `v` is (a message where it says no type), for the union's choice."""
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return "message" if kind is None else kind


def known_items(v: Any) -> Any:
    """Input items of other types (reasoning, item references, other tools' calls) are refused, saying so."""
    for item in v if isinstance(v, list) else ():
        kind = item_type(item)
        if kind not in ITEM_TYPES:
            raise ValueError(f"unsupported:input:input items of type {kind!r} are not supported here "
                             f"(messages, function_call and function_call_output are)")
    return v


InputItem = Annotated[Union[tuple(Annotated[cls, Tag(kind)] for kind, cls in ITEM_TYPES.items())],
                      Discriminator(item_type)]


class ResponseTool(FunctionDef):
    """A function tool of the Responses API (its fields beside `type`, where chat nests them in `function`)."""
    type: Literal["function"]


class ResponseToolChoice(Strict):
    type: Literal["function"]
    name: str

    def named(self) -> str:
        return self.name


class ConversationCreate(Strict):
    items: list[InputItem] | None = Field(None, max_length=20)
    metadata: dict[str, str] | None = None  # accepted, not kept: a conversation holds its KV, messages, settings
    seed: int | None = Field(None, ge=0, lt=2**63)  # kvstore: the session's seed (random when not given)


    _known = field_validator("items", mode="before")(known_items)

    def messages(self) -> list[dict[str, str]]:
        return tools.item_messages(self.items or [], None)


class ItemsCreate(Strict):
    items: list[InputItem] = Field(min_length=1, max_length=20)

    _known = field_validator("items", mode="before")(known_items)

    def messages(self) -> list[dict[str, str]]:
        return tools.item_messages(self.items, None)


class ResponseRequest(Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None  # a system message before the input (kept in the context: it is KV)
    conversation: str | dict[str, str] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)  # kvstore: a new session's seed (a conversation's is fixed)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # no effect: every response's KV is kept anyway
    safety_identifier: str | None = None
    kvstore_trace: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    text: TextOptions | None = None  # its format: this response's reply only
    tools: list[ResponseTool] | None = Field(None, max_length=MAX_TOOLS)  # stated with the instructions (tools.py)
    # after tools and text (its check reads them), checked when not given too
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: bool | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v):
        for tool in v if isinstance(v, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"unsupported:tools:only function tools are supported here, not {kind!r}")
        return v

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, v):
        check_parameters(v or [])
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v, info):
        text = info.data.get("text")
        check_tool_choice(v, [t.name for t in info.data.get("tools") or ()], text.format if text is not None else None,
                          "text.format")
        return v

    @field_validator("include")
    @classmethod
    def _known_includes(cls, v):
        unknown = sorted(set(v or ()) - NOTHING_TO_INCLUDE - {LOGPROBS_INCLUDE})
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not something a response can include "
                             f"(e.g. {LOGPROBS_INCLUDE!r})")
        return v

    def alternatives(self) -> int | None:
        """None, or how many likeliest tokens each output token's logprobs list: asked for by
        `include` (or by `top_logprobs` alone)."""
        if LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    _known = field_validator("input", mode="before")(known_items)

    @field_validator("input")
    @classmethod
    def _ends_with_user(cls, v):
        if isinstance(v, list) and (not v or (v[-1].type != "function_call_output" and getattr(v[-1], "role", None) != "user")):
            raise ValueError("the input must end with a user message or a function_call_output (the turn to answer)")
        return v

    @model_validator(mode="after")
    def _one_context(self):
        if self.conversation is not None and self.previous_response_id is not None:
            raise ValueError("give either conversation or previous_response_id, not both")
        return self

    def input_messages(self) -> list[dict[str, str]]:
        """The input as the session holds it: a system message of the instructions and the tools' text
        (`tools.py`: stated with every request that gives them, as its instructions are), then the items."""
        functions = self.tools or []
        given = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else \
            tools.item_messages(self.input, functions)
        system = tools.with_tools(self.instructions, functions) if functions else self.instructions
        return ([{"role": "system", "content": system}] if system else []) + given

    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, dict):
            return self.conversation.get("id")
        return self.conversation

    def sampler(self) -> dict[str, float]:
        return {k: float(v) for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}

    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def format(self) -> dict[str, Any] | None:
        """The reply's response format as the library takes it (None: free text)."""
        if self.tools:
            return tools_format(self.tools, self.tool_choice, self.parallel_tool_calls)
        return self.text_format().library() if self.text_format() is not None else None

    def text_shown(self) -> dict[str, Any]:
        """`text` as the response object echoes it."""
        fmt = self.text_format()
        return {"format": fmt.shown() if fmt is not None else {"type": "text"}}


class TokenizeRequest(Strict):
    """POST /tokenize (vLLM's and llama.cpp's): a prompt, or chat messages, as the model reads them."""
    model: str
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # a prompt: the model's BOS where it adds one (as a completion's prompt)
    add_generation_prompt: bool = True  # messages: the assistant's turn opened (as a chat request's)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(Strict):
    model: str
    tokens: list[int]


class ForkRequest(Strict):
    name: str
    at: int | None = Field(None, ge=1)


class SessionCreate(Strict):
    name: str
    system: str | None = None
    seed: int = Field(0, ge=0, lt=2**63)
    temperature: float = Field(0.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
