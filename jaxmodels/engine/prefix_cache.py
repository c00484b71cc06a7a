"""Prefix caching on the host: pages of computed tokens kept after their requests and found again by content.

A page of page_size tokens holds the caches (KV, MLA latent, indexer keys) of those tokens, which depend only on the
tokens from the start of the sequence to the page's end. So a full page is keyed by its tokens and its parent page
(the page before it): the cache is a tree whose paths from the root are token prefixes, one page per node. Pages
in the tree are shared read-only by the requests that match them (a request writes only past its match, which ends
on a page edge); a page held by no request stays cached until the pool needs it, and is then evicted least
recently used. Leaves go first: a request that used a page used every page before it, and releasing touches a
path from its leaf up to the root, so a parent is never older than its children.

A recurrent layer (Mamba) has no pages: its state after token t holds the whole prefix. A hybrid model can resume
only where a state was saved, so a node may also hold a state snapshot (a slot of the state pools set aside for
the cache), and a hybrid's match ends at the deepest matched node with one. Snapshots are saved where later
prompts are likely to resume: at the last page edge before a prompt's last token (the next turn of a conversation
resumes there, and so does the same prompt sent again), and at the page edge where a prompt leaves a cached path
that goes on with other tokens, if no snapshot is there (a shared system prompt's end: the second request that
shares it saves the state there, and every later one resumes from it). Not where a prompt merely extends a cached
path (a conversation's next turn after the previous answer's pages): nothing else would resume there. Snapshots
have their own pool, evicted least recently used, and go with their node's page.

What a request leaves when it ends (or is preempted) is a tail (`CachedTail`): its last, partial page and the
recurrent state after its last computed token, which need not be on a page edge. A conversation's next turn starts
with exactly those tokens, so it resumes there: it takes the tail's page as its own (no copy: a tail serves one
request) and the state, which the scheduler leaves in the ended request's slot until another request needs the
slot, then stashes in a snapshot slot. The same holds for a preempted request, which finds its own tail.

Everything here is host bookkeeping; the device copies between request slots and snapshot slots ride on the
extend steps' batches (engine.batch.StateCopies).
"""

import collections
import dataclasses
import itertools


@dataclasses.dataclass(eq=False, slots=True)  # slots: the tree has a node per cached page, made on the hot path
class CachedPage:
    """A node of the tree: the page holding the tokens `tokens` after its parent's, for as many requests as hold it
    (refs); `snapshot`: a snapshot slot holding the recurrent state after this page's last token, or None."""

    node_id: int
    parent: "CachedPage | None"
    tokens: tuple
    page: int
    depth: int  # pages from the root, this one included: the prefix ends at depth * page_size tokens
    refs: int = 0
    children: int = 0
    snapshot: int | None = None


@dataclasses.dataclass(eq=False, slots=True)
class CachedTail:
    """The end of an ended request's computed tokens: `tokens` (fewer than a page; none when it ended on a page
    edge) after `parent`'s page, their caches in `page` (None without tokens). A hybrid's state after them is in
    `slot` (the ended request's, kept aside by the scheduler) or, once that slot was needed, in `snapshot`; with
    neither (its snapshot was reused) it can no longer be resumed from."""

    node_id: int
    parent: CachedPage | None
    tokens: tuple
    page: int | None
    slot: int | None = None
    snapshot: int | None = None
    dropped: bool = False  # evicted, taken, or cleared: the scheduler gives its slot to the next request plainly


@dataclasses.dataclass
class Match:
    """What a prompt finds in the cache: `pages` (the tree path, root first) it can reuse, covering `tokens`
    tokens, and the snapshot slot to resume the recurrent state from (None: no recurrent state, or nothing matched).
    `shared`: how many pages of the prompt the tree holds, past a hybrid's last snapshot too; `parts`: whether the
    prompt leaves there a path the tree goes on with (the last shared page has cached pages after it: another
    prompt's continuation), which makes that page edge a place later prompts will resume from. `tail`: the tail
    the prompt resumes after (then `tokens` ends past the last page, and a tail whose state is still in its slot
    has no `snapshot`: the request takes that slot)."""

    pages: list
    tokens: int
    snapshot: int | None
    shared: int
    parts: bool = False
    tail: CachedTail | None = None


class PrefixCache:
    def __init__(self, page_size: int, snapshot_slots: list[int] | None):
        """`snapshot_slots`: the state-pool slots set aside for snapshots, or None for a model without recurrent
        state (its matches need no snapshot)."""
        self.page_size = page_size
        self.recurrent = snapshot_slots is not None
        self._ids = itertools.count(1)
        self._children: dict[tuple, CachedPage] = {}  # (parent node id or 0, tokens) -> node
        self._idle: collections.OrderedDict[int, CachedPage] = collections.OrderedDict()  # refs == 0, oldest first
        self._free_snapshots = list(snapshot_slots or [])
        self._snapshots: collections.OrderedDict[int, CachedPage | CachedTail] = collections.OrderedDict()  # LRU
        self._tails: dict[int, list[CachedTail]] = {}  # parent node id or 0 -> its tails
        self._tail_pages = 0  # tails' pages: idle, as no request holds a tail (resumable or not)
        self.hit_tokens = 0  # cumulative tokens matched by admitted requests

    def __len__(self) -> int:
        """Pages the cache holds: the tree's and its tails'."""
        return len(self._children) + self._tail_pages

    @property
    def idle_pages(self) -> int:
        """Cached pages no running request holds: the pool can take them back."""
        return len(self._idle)

    @property
    def snapshots(self) -> int:
        return len(self._snapshots)

    def match(self, token_ids: list[int], limit: int) -> Match:
        """The longest cached prefix of token_ids[:limit] (whole pages), ending where a request can resume."""
        size, parent, path = self.page_size, None, []
        for start in range(0, limit - size + 1, size):
            node = self._children.get((parent.node_id if parent else 0, tuple(token_ids[start: start + size])))
            if node is None:
                break
            path.append(node)
            parent = node
        shared, parts = len(path), bool(path) and path[-1].children > 0
        tail, tail_depth = self._tail_match(token_ids, limit, path)
        if tail is not None:
            tail_pages = path[:tail_depth]
        if self.recurrent:
            while path and path[-1].snapshot is None:
                path.pop()
        if tail is not None and tail_depth * size + len(tail.tokens) > len(path) * size:
            return Match(pages=tail_pages, tokens=tail_depth * size + len(tail.tokens), snapshot=tail.snapshot,
                         shared=shared, parts=parts, tail=tail)
        snapshot = path[-1].snapshot if path and self.recurrent else None
        return Match(pages=path, tokens=len(path) * size, snapshot=snapshot, shared=shared, parts=parts)

    def _tail_match(self, token_ids: list[int], limit: int, path: list) -> tuple[CachedTail | None, int]:
        """The tail after the root or a node of `path` that token_ids continue with and that ends furthest (at most
        at `limit`), and the depth of its parent."""
        best, best_depth, best_end = None, 0, 0
        for depth, node in enumerate([None] + path):
            for tail in self._tails.get(node.node_id if node else 0, ()):
                end = depth * self.page_size + len(tail.tokens)
                if (best_end < end <= limit and (not self.recurrent or tail.slot or tail.snapshot)
                        and tuple(token_ids[depth * self.page_size: end]) == tail.tokens):
                    best, best_depth, best_end = tail, depth, end
        return best, best_depth

    def hold(self, pages: list) -> None:
        """A request starts using `pages` (a path from the root): they leave the idle list."""
        for node in pages:
            if node.refs == 0:
                del self._idle[node.node_id]
            node.refs += 1
            if node.snapshot is not None:
                self._snapshots.move_to_end(node.snapshot)

    def release(self, pages: list) -> None:
        """A request stops using `pages` (a path from the root): those it was the last to hold become idle, the
        leaf end first, so that they are evicted before their parents."""
        for node in reversed(pages):
            node.refs -= 1
            if node.refs == 0:
                self._idle[node.node_id] = node

    def insert(self, parent: CachedPage | None, tokens: tuple, page: int) -> tuple[CachedPage, bool]:
        """Cache `page`, holding `tokens` after `parent`'s, for the request that computed it (which holds it):
        (its node, True); or, when the tree has these tokens already (another request computed them at the same
        time), (that node, held now, False), and `page` stays the request's own."""
        key = (parent.node_id if parent else 0, tokens)
        node = self._children.get(key)
        if node is not None:
            self.hold([node])
            return node, False
        node = CachedPage(next(self._ids), parent, tokens, page, (parent.depth if parent else 0) + 1, refs=1)
        self._children[key] = node
        if parent is not None:
            parent.children += 1
        return node, True

    def add_tail(self, parent: CachedPage | None, tokens: tuple, page: int | None, slot: int | None) -> CachedTail:
        """Keep what an ending request leaves after `parent` (see CachedTail); call it before releasing the
        request's pages, so that its page is evicted before theirs."""
        tail = CachedTail(next(self._ids), parent, tokens, page, slot=slot)
        self._tails.setdefault(parent.node_id if parent else 0, []).append(tail)
        if page is not None:
            self._idle[tail.node_id] = tail
            self._tail_pages += 1
        return tail

    def take_tail(self, tail: CachedTail) -> None:
        """A request resumes after `tail`: it takes the tail's page and state (its step restores the snapshot
        before anything can write the freed snapshot slot), and the tail is gone."""
        self._discard_tail(tail)

    def stash(self, tail: CachedTail) -> int | None:
        """The tail's state leaves its request slot, which another request needs: the snapshot slot it goes to (the
        least recently used snapshot's if none is free), or None, and the tail is dropped."""
        tail.slot = None
        slot = self._new_snapshot(tail)
        if slot is None:
            self._unindex(tail)
            tail.dropped = True
        else:
            self.supersede(tail)
        return slot

    def evict(self, count: int) -> list[int]:
        """Take back up to `count` idle pages, least recently used first (leaves before their parents): their page
        ids, now free, and their snapshots freed (and the tails after an evicted page, whose pages come too)."""
        pages = []
        while len(pages) < count and self._idle:
            node = next(iter(self._idle.values()))
            if isinstance(node, CachedTail):
                pages.append(self._discard_tail(node))
                continue
            del self._idle[node.node_id]
            assert node.children == 0, "an idle page with cached children was evicted first"
            del self._children[(node.parent.node_id if node.parent else 0, node.tokens)]
            if node.parent is not None:
                node.parent.children -= 1
            self._drop_snapshot(node)
            pages.append(node.page)
            pages += self._drop_tails_after(node)
        return pages

    def _drop_tails_after(self, node: CachedPage | None) -> list[int]:
        """Drop the tails after `node` (the root for None); returns their pages."""
        pages = [self._discard_tail(tail) for tail in list(self._tails.get(node.node_id if node else 0, ()))]
        return [page for page in pages if page is not None]

    def _discard_tail(self, tail: CachedTail) -> int | None:
        """Drop `tail` and take its page out of the idle list: the page, now the caller's, or None (it had none,
        or its page went already)."""
        page = None
        if self._idle.pop(tail.node_id, None) is not None:
            self._tail_pages -= 1
            page = tail.page
        self._drop_tail(tail)
        return page

    def _drop_tail(self, tail: CachedTail) -> None:
        self._unindex(tail)
        self._drop_snapshot(tail)
        tail.dropped = True

    def _unindex(self, tail: CachedTail) -> None:
        key = tail.parent.node_id if tail.parent else 0
        tails = self._tails.get(key, [])
        if tail in tails:
            tails.remove(tail)
            if not tails:
                del self._tails[key]

    def snapshot_slot(self, node: CachedPage) -> int | None:
        """A snapshot slot for the state after `node`'s last token, from the free ones or the least recently used
        snapshot's; None when the node has one already (or the model keeps no recurrent state)."""
        if not self.recurrent or node.snapshot is not None:
            return None
        return self._new_snapshot(node)

    def _new_snapshot(self, owner: CachedPage | CachedTail) -> int | None:
        if not self._free_snapshots:
            if not self._snapshots:
                return None
            _, oldest = self._snapshots.popitem(last=False)
            self._free_snapshots.append(oldest.snapshot)
            oldest.snapshot = None
            if isinstance(oldest, CachedTail):  # no longer resumable; its page stays idle until evicted
                self._unindex(oldest)
        owner.snapshot = self._free_snapshots.pop()
        self._snapshots[owner.snapshot] = owner
        return owner.snapshot

    def supersede(self, node: CachedPage | CachedTail) -> None:
        """A snapshot was just saved at `node`: the snapshots above it on its path whose page has one continuation
        only (no other prompt parted there) are now of use only to a prompt that would part inside this path, so
        they become the first to be reused. Without this, a conversation's snapshot of its previous turn, touched
        when the current turn resumed from it, outlives the latest turn's snapshot of a conversation that has not
        come back yet."""
        node = node.parent
        while node is not None:
            if node.snapshot is not None and node.children <= 1:
                self._snapshots.move_to_end(node.snapshot, last=False)
            node = node.parent

    def _drop_snapshot(self, owner: CachedPage | CachedTail) -> None:
        if owner.snapshot is not None:
            del self._snapshots[owner.snapshot]
            self._free_snapshots.append(owner.snapshot)
            owner.snapshot = None

    def clear(self) -> list[int]:
        """Evict every idle page (with its snapshot) and every tail; returns their page ids."""
        pages = self.evict(len(self._idle))
        for key in list(self._tails):  # tails without pages, after pages that running requests hold
            for tail in list(self._tails.get(key, ())):
                self._drop_tail(tail)
        return pages
