"""A radix prefix cache over the KV pool: requests' K/V stays indexed by (adapter, token ids), a
running request's prompt as soon as it is prefilled (`adopt`) and the rest when it finishes
(`insert`), and a new request starts from its longest cached prefix (extend attention reads a
cached prefix like an earlier chunk of the same prompt).

Each adapter (None: the base model) has a tree of its own, so a prompt under two adapters never
shares K/V. A node holds a run of tokens and their KV slots; requests running on a prefix lock its
path (reference counts), and the slots of unlocked nodes count as free: the scheduler evicts them,
least recently used leaves first, when the pool needs room."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from compiled.attention.kv_cache import KVPool


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    slots: np.ndarray
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0
    queued: bool = False      # has an entry in the eviction heap (maybe stale; see `evict`)


@dataclass
class Prefix:
    """A request's cached prefix: its slots (positions 0..len-1) and the node that ends it, locked."""
    slots: np.ndarray
    node: Node

    def __len__(self) -> int:
        return len(self.slots)


class PrefixCache:
    def __init__(self, kv: KVPool) -> None:
        self.kv = kv
        self.roots: dict[str | None, Node] = {}
        self.num_cached = 0          # slots the tree holds
        self.num_locked = 0          # of which in nodes some request locks
        self.queried = 0             # prompt tokens looked up, and found
        self.hit = 0
        self._clock = itertools.count(1)
        # Unlocked leaves by (last_used, id): every one has an entry, so evicting needs no tree walk.
        # Entries are left to go stale (the leaf gets a child, is locked or used again) rather than
        # searched for and removed; `evict` skips or re-keys them when they surface.
        self._leaves: list[tuple[int, int, Node]] = []

    @property
    def num_evictable(self) -> int:
        return self.num_cached - self.num_locked

    # ---- lookups -------------------------------------------------------------------------------

    def match(self, adapter: str | None, tokens: list[int]) -> Prefix | None:
        """The longest cached prefix of `tokens` under `adapter`, locked (`release` unlocks it);
        None when nothing matches."""
        self.queried += len(tokens)
        node, i, parts = self.roots.get(adapter), 0, []
        while node is not None and i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = common_prefix_len(child.tokens, tokens, i)
            if k < len(child.tokens):
                child = self._split(child, k)
            parts.append(child.slots)
            node, i = child, i + k
        if not parts:
            return None
        self.hit += i
        self._lock(node, +1)
        return Prefix(np.concatenate(parts), node)

    def release(self, prefix: Prefix | None) -> None:
        if prefix is not None:
            self._lock(prefix.node, -1)

    def insert(self, adapter: str | None, tokens: list[int], slots: np.ndarray, prefix: Prefix | None) -> np.ndarray:
        """Index `slots` (of `tokens`, from position 0) under `adapter`; the request's own slots
        that duplicate what the tree already holds come back, for the pool. Positions below
        `prefix` are the tree's already; `prefix` is released."""
        _, held = self._place(adapter, tokens, slots, prefix)
        self.release(prefix)
        return _joined([slots[lo:hi] for lo, hi, _, _ in held])

    def adopt(self, adapter: str | None, tokens: list[int], slots: np.ndarray,
              prefix: Prefix | None) -> tuple[Prefix, np.ndarray, list[tuple[int, np.ndarray]]]:
        """A running request's computed `tokens` (its prompt) go into the tree now, so that requests
        admitted after it start from them. Returns its new prefix (all of `tokens`, locked; the old
        `prefix` released), its slots the tree already held K/V for (to free), and where its
        request->token row must point at the tree's slots instead: (position, slots) runs."""
        node, held = self._place(adapter, tokens, slots, prefix)
        self._lock(node, +1)
        self.release(prefix)
        path, n = [], node
        while n.parent is not None:
            path.append(n.slots)
            n = n.parent
        repoint = [(lo, child.slots[lo - start:hi - start]) for lo, hi, start, child in held]
        return Prefix(np.concatenate(path[::-1]), node), _joined([slots[lo:hi] for lo, hi, _, _ in held]), repoint

    def _place(self, adapter: str | None, tokens: list[int], slots: np.ndarray,
               prefix: Prefix | None) -> tuple[Node, list[tuple[int, int, int, Node]]]:
        """Walk `tokens` down `adapter`'s tree (splitting where they part) and hang what it lacks,
        with `slots`, as a new leaf. Returns the node of the last token and the runs [lo, hi) at or
        past `prefix` that the tree already held: (lo, hi, the node's first position, the node)."""
        owned_from = len(prefix) if prefix is not None else 0
        node, i, held = self.roots.setdefault(adapter, Node((), np.empty(0, np.int64))), 0, []
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = Node(tuple(tokens[i:]), slots[i:].copy(), parent=node, last_used=now)
                node.children[tokens[i]] = child
                self.num_cached += len(child.slots)
                self._offer(child)
                return child, held
            k = common_prefix_len(child.tokens, tokens, i)
            if k < len(child.tokens):
                child = self._split(child, k)
            if i + k > owned_from:
                held.append((max(i, owned_from), i + k, i, child))
            child.last_used = now
            node, i = child, i + k
        return node, held

    # ---- room ----------------------------------------------------------------------------------

    def evict(self, n: int) -> None:
        """Free at least `n` slots (as many as there are unlocked) from least recently used leaves."""
        freed = 0
        while freed < n and self._leaves:
            used, _, leaf = heapq.heappop(self._leaves)
            leaf.queued = False
            if leaf.children or leaf.refs:
                continue            # not evictable now; `_offer` queues it again once it is
            if used != leaf.last_used:
                # Used since it was queued. Times only grow, so every key is at most its node's
                # time, and the first up-to-date entry popped is the least recently used leaf.
                self._offer(leaf)
                continue
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self.kv.free(leaf.slots)
            self.num_cached -= len(leaf.slots)
            freed += len(leaf.slots)
            self._offer(parent)

    def drop(self, adapter: str | None) -> None:
        """Forget every prefix of `adapter` (its weights changed or are gone); none may be locked."""
        root = self.roots.pop(adapter, None)
        if root is None:
            return
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            assert node.refs == 0, "a prefix of an adapter being dropped is in use"
            self.kv.free(node.slots)
            self.num_cached -= len(node.slots)
            stack += node.children.values()
            node.parent = None      # marks it gone, for the filter below
        # Their slots are free already, so their entries must never surface in `evict`.
        self._leaves = [e for e in self._leaves if e[2].parent is not None]
        heapq.heapify(self._leaves)

    # ---- internals -----------------------------------------------------------------------------

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k tokens; the upper part (returned) takes its place."""
        upper = Node(node.tokens[:k], node.slots[:k], parent=node.parent, refs=node.refs, last_used=node.last_used)
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.slots, node.parent = node.tokens[k:], node.slots[k:], upper
        upper.children[node.tokens[0]] = node
        return upper

    def _lock(self, node: Node, delta: int) -> None:
        now = next(self._clock)
        while node is not None and node.parent is not None:
            node.last_used = now  # first, so that `_offer` queues it under its new time
            if node.refs == 0 and delta > 0:
                self.num_locked += len(node.slots)
            node.refs += delta
            if node.refs == 0 and delta < 0:
                self.num_locked -= len(node.slots)
                self._offer(node)
            node = node.parent

    def _offer(self, node: Node) -> None:
        """Queue `node` for eviction if it is an unlocked leaf (a root never is). At most one entry
        per node keeps the heap no bigger than the tree; an entry whose node was used since is
        re-keyed by `evict` when it surfaces."""
        if not node.queued and node.parent is not None and not node.children and node.refs == 0:
            node.queued = True
            heapq.heappush(self._leaves, (node.last_used, id(node), node))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def common_prefix_len(edge: Sequence[int], tokens: Sequence[int], start: int = 0) -> int:
    """How many leading tokens of `edge` equal those of `tokens` from `start` on. Slices compared
    in C, halving where they differ: a step admitting 31 requests behind a cached 1,000-token
    prefix spent 28 ms walking such prefixes token by token in Python (bench/RESULTS.md)."""
    n = max(min(len(edge), len(tokens) - start), 0)
    a, b = list(edge[:n]), list(tokens[start:start + n])
    if a == b:
        return n
    lo, hi = 0, n   # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
