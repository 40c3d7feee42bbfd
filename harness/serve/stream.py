"""`moebench serve`'s text stream: a sequence's output ids turned into text pieces as they come."""

from __future__ import annotations


class TextStream:
    """A sequence's output as text pieces, sent as tokens are made.

    Tokens are detokenized incrementally (a short window of recent tokens, re-decoded until it ends
    in a whole character), and text that could be the start of a stop string is held back until it
    is not: a stop string must never reach the client. When the sequence finishes, the engine's own
    text (cut at the stop string) is what counts; the pieces sent before are a prefix of it."""

    __slots__ = ("tokenizer", "stops", "stop_heads", "prefix_offset", "read_offset", "text", "sent")

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = stops
        # the characters that can end a proper prefix of a stop string: text ending in none of them
        # holds nothing back (the common case, checked in one set lookup)
        self.stop_heads = frozenset(ch for stop in stops for ch in stop[:-1])
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` handed out

    def advance(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        window = decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        end = len(self.text) - self._held_back()
        if end <= self.sent:
            return ""
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def _held_back(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        text, longest = self.text, 0
        if not text or text[-1] not in self.stop_heads:
            return 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def finish(self, final_text: str) -> tuple[str, bool]:
        """The rest of the final text, and whether what was sent is really its prefix."""
        sent = self.text[:self.sent]
        ok = final_text.startswith(sent)
        rest = final_text[self.sent:] if ok else ""
        self.sent = len(final_text)
        return rest, ok
