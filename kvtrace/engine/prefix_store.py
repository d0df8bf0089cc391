"""What the external KV store holds: token prefixes, evicted least recently used
first when their total length exceeds the capacity.

KV of a position depends only on the tokens up to it, so holding a sequence
means holding KV for every prefix of it. Entries are token-granular: a hit may
end in the middle of a block.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([tuple(a), tuple(b)]))


class PrefixStore:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[tuple[int, ...], None] = OrderedDict()  # oldest first
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, tokens: Sequence[int]) -> tuple[int, tuple[int, ...] | None]:
        """How many leading ``tokens`` the store holds, and the entry holding them.
        Has no side effects (a lookup may be repeated at every scheduling attempt)."""
        tokens = tuple(tokens)
        best, best_entry = 0, None
        for entry in self._entries:
            n = common_prefix_len(entry, tokens)
            if n > best:
                best, best_entry = n, entry
        return best, best_entry

    def touch(self, entry: tuple[int, ...]) -> None:
        if entry in self._entries:
            self._entries.move_to_end(entry)

    def save(self, tokens: Sequence[int]) -> None:
        tokens = tuple(tokens[: self.capacity_tokens])
        if not tokens:
            return
        for entry in self._entries:
            if len(entry) >= len(tokens) and entry[: len(tokens)] == tokens:
                self.touch(entry)          # already held
                return
        for entry in [e for e in self._entries if tokens[: len(e)] == e]:
            self._remove(entry)            # covered by the new, longer entry
        self._entries[tokens] = None
        self.num_tokens += len(tokens)
        while self.num_tokens > self.capacity_tokens:
            self._remove(next(iter(self._entries)))

    def _remove(self, entry: tuple[int, ...]) -> None:
        del self._entries[entry]
        self.num_tokens -= len(entry)
