"""Stop strings, matched on the detokenized text across token boundaries and never emitted.

While streaming, text that could still grow into a stop string is held back: once emitted it cannot be taken back.
"""


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""  # all text seen so far (up to the stop, once matched)
        self.emitted = 0  # how much of it has been released
        self.matched = False

    def add(self, text: str) -> str:
        """Take new text; returns what can be released now. After a match, `matched` is set and the text ends
        just before the stop string."""
        if not self.stops:
            self.text += text
            self.emitted = len(self.text)
            return text
        # A match must end inside the new text, so it starts at most longest - 1 characters before it.
        start = max(0, len(self.text) - self.longest + 1)
        self.text += text
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.matched = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Release what was held back: the output ended, so nothing more can complete a stop string."""
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        for n in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out
