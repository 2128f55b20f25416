"""One chat choice's generated text read as content and tool calls, whole or as a stream.

Streamed calls arrive as OpenAI sends them: per call, a first delta with `index`, `id`,
`type` and `function.name` (arguments ""), then argument fragments. A named function's
arguments stream as they are generated; other calls are sent once their text is complete
(it must parse first), while text that is certainly content streams at once. Concatenating a
stream's deltas gives the same message as the whole response.
"""
import uuid

from pdserve.router.openai.responses import FunctionCallOut, FunctionDelta, ToolCallDelta, ToolCallOut
from pdserve.router.openai.structured.tool_parsers import ParsedCall, ParsedOutput, parse_call_list
from pdserve.router.openai.structured.tools import ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_output(plan: ToolPlan, text: str) -> ParsedOutput:
    """The finished text of a choice as content and calls."""
    if plan.mode == "named":
        return ParsedOutput(None, (ParsedCall(plan.function or "", text),))
    if plan.mode == "required":
        return parse_call_list(text)
    if plan.mode == "auto" and plan.parser is not None:
        return plan.parser.parse(text)
    return ParsedOutput(text)


def finish_reason_of(parsed: ParsedOutput, finish_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended by calling tools."""
    return "tool_calls" if parsed.calls and finish_reason == "stop" else finish_reason


def tool_calls_out(parsed: ParsedOutput) -> list[ToolCallOut]:
    return [ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in parsed.calls]


class ToolCallStream:
    """One choice's stream: text deltas in, content and tool-call deltas out."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._text = ""
        self._num_content_sent = 0  # characters of `_text` already sent as content
        self._num_calls_sent = 0

    def feed(self, text: str, finish_reason: str | None) -> tuple[str, list[ToolCallDelta], str | None]:
        """(content delta, tool-call deltas, finish reason) for one output of the choice."""
        self._text += text
        if self._plan.mode == "none":
            return text, [], finish_reason
        if self._plan.mode == "named":
            return "", self._named_deltas(text), finish_reason_of(read_output(self._plan, self._text), finish_reason)
        if finish_reason is None:
            return self._content_upto(self._content_len()), [], None
        parsed = read_output(self._plan, self._text)
        if not parsed.calls:
            return self._content_upto(len(self._text)), [], finish_reason
        content = self._content_upto(len(parsed.content or ""))
        return content, self._call_deltas(parsed.calls), finish_reason_of(parsed, finish_reason)

    def _content_len(self) -> int:
        if self._plan.mode == "auto" and self._plan.parser is not None:
            return self._plan.parser.content_len(self._text, False)
        return 0  # required: the whole output is the call list

    def _content_upto(self, end: int) -> str:
        piece = self._text[self._num_content_sent:end]
        self._num_content_sent = max(self._num_content_sent, end)
        return piece

    def _named_deltas(self, text: str) -> list[ToolCallDelta]:
        deltas = []
        if self._num_calls_sent == 0:
            self._num_calls_sent = 1
            deltas.append(ToolCallDelta(index=0, id=new_call_id(), type="function",
                                        function=FunctionDelta(name=self._plan.function, arguments="")))
        if text:
            deltas.append(ToolCallDelta(index=0, function=FunctionDelta(arguments=text)))
        return deltas

    def _call_deltas(self, calls: tuple[ParsedCall, ...]) -> list[ToolCallDelta]:
        deltas = []
        for index, call in enumerate(calls):
            deltas.append(ToolCallDelta(index=index, id=new_call_id(), type="function",
                                        function=FunctionDelta(name=call.name, arguments="")))
            deltas.append(ToolCallDelta(index=index, function=FunctionDelta(arguments=call.arguments)))
        return deltas
