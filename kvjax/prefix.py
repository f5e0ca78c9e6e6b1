"""The page allocator of a paged cache, with automatic prefix caching.

Host-side bookkeeping (plain Python, no arrays): which pages are free,
how many sequences hold each page, and which full pages are cached under
the tokens they hold, so that a new sequence whose prompt starts with the
same tokens maps those pages instead of recomputing them (vLLM's automatic
prefix caching).

  key of a full block   (parent node, its Y token ids): the node names the
                        whole prefix up to and including the block, so two
                        blocks with the same tokens after different prefixes
                        never match. Dict lookup compares the key itself,
                        not only its hash: a match is exact.
  reference counts      a page is held by every sequence that maps it; a
                        page held by more than one sequence, or cached,
                        is never written in place (copy-on-write: the
                        writer gets a private copy, `shared`).
  eviction              cached pages no sequence holds stay cached until
                        a page is needed and no page is free; then the
                        least recently released one is evicted (LRU).
                        Sequences release their pages last block first,
                        so a prefix's deeper blocks go before its root.

Only full blocks are cached: a block is immutable once all Y slots hold
tokens (slot = position), and its K/V depend on nothing but the prefix.
"""

from __future__ import annotations

import collections
import dataclasses

from kvjax.validate import check_int

ROOT = 0  # parent node of a sequence's first block


@dataclasses.dataclass
class Chain:
  """How far a sequence's blocks have been offered to the cache: `blocks`
  full blocks walked, the last one's node `parent` (ROOT before any);
  `broken` once the prefix it extends was evicted (nothing after it can be
  matched again, so nothing more is offered)."""

  blocks: int = 0
  parent: int = ROOT
  broken: bool = False


class PageAllocator:
  """Free list, reference counts and the prefix cache of one page pool."""

  def __init__(self, num_pages: int, page_size: int,
               prefix_caching: bool = True):
    self.num_pages = check_int("num_pages", num_pages, 1)
    self.page_size = check_int("page_size", page_size, 1)
    self.prefix_caching = bool(prefix_caching)
    self.free = collections.deque(range(num_pages))
    self.refs = [0] * num_pages
    self.key_of: dict[int, tuple] = {}  # cached page -> key
    self.page_of: dict[tuple, int] = {}  # key -> cached page
    self.node_of: dict[int, int] = {}  # cached page -> node id
    self.node_page: dict[int, int] = {}  # node id -> cached page
    self.evictable: collections.OrderedDict[int, None] = (
        collections.OrderedDict())  # cached, unheld; oldest first
    self._next_node = ROOT + 1
    self.evictions = 0

  # ---- counts ---------------------------------------------------------------
  @property
  def available(self) -> int:
    """Pages an `allocate` can hand out now (free + evictable cached)."""
    return len(self.free) + len(self.evictable)

  @property
  def held(self) -> int:
    """Pages at least one sequence holds."""
    return sum(1 for r in self.refs if r > 0)

  @property
  def cached(self) -> int:
    """Pages in the prefix cache (held or not)."""
    return len(self.key_of)

  # ---- allocation -----------------------------------------------------------
  def allocate(self, n: int) -> list[int] | None:
    """`n` pages held once each, or None (nothing taken) if fewer are
    available. Free pages first, then the least recently released cached
    ones (evicted from the cache)."""
    if n > self.available:
      return None
    out = []
    for _ in range(n):
      if self.free:
        page = self.free.popleft()
      else:
        page, _ = self.evictable.popitem(last=False)
        self._uncache(page)
        self.evictions += 1
      self.refs[page] = 1
      out.append(page)
    return out

  def retain(self, page: int) -> None:
    """One more holder of a cached page."""
    self.refs[page] += 1
    self.evictable.pop(page, None)

  def release(self, page: int) -> None:
    """One holder fewer; an unheld page goes back to the free list, or,
    if cached, to the most recent end of the LRU."""
    if self.refs[page] < 1:
      raise ValueError(f"page {page} released more often than held")
    self.refs[page] -= 1
    if self.refs[page] == 0:
      if page in self.key_of:
        self.evictable[page] = None
      else:
        self.free.append(page)

  def release_all(self, pages) -> None:
    """Releases a sequence's pages, last block first (LRU order: deeper
    blocks of a prefix are evicted before the blocks they extend)."""
    for page in reversed(list(pages)):
      self.release(page)

  def shared(self, page: int) -> bool:
    """Whether writing into `page` in place would change what another
    sequence or the prefix cache sees (copy-on-write needed)."""
    return self.refs[page] > 1 or page in self.key_of

  def _uncache(self, page: int) -> None:
    key = self.key_of.pop(page)
    del self.page_of[key]
    self.node_page.pop(self.node_of.pop(page))

  # ---- the prefix cache -----------------------------------------------------
  def match(self, tokens, max_blocks: int) -> list[int]:
    """The cached pages of the longest run of `tokens`' leading full blocks
    (at most `max_blocks`), each retained once for the caller."""
    if not self.prefix_caching:
      return []
    Y, parent, out = self.page_size, ROOT, []
    for i in range(min(max_blocks, len(tokens) // Y)):
      page = self.page_of.get((parent, tuple(tokens[i * Y:(i + 1) * Y])))
      if page is None:
        break
      self.retain(page)
      out.append(page)
      parent = self.node_of[page]
    return out

  def offer(self, chain: Chain, tokens, pages, filled: int) -> None:
    """Caches the full blocks of a sequence not offered yet: block i
    (tokens[i·Y:(i+1)·Y] in pages[i]) when its `filled` slots cover it.
    A block whose content is cached already (another page computed it
    first) keeps its page private; its node still leads the chain."""
    if not self.prefix_caching:
      return
    Y = self.page_size
    while not chain.broken and (chain.blocks + 1) * Y <= filled:
      i = chain.blocks
      key = (chain.parent, tuple(tokens[i * Y:(i + 1) * Y]))
      page = self.page_of.get(key)
      if page is None and chain.parent != ROOT and (
          chain.parent not in self.node_page):
        # The prefix this block extends was evicted: its key could never
        # be matched again (matches walk from the root).
        chain.broken = True
        return
      if page is None:
        page = pages[i]
        if page in self.key_of:  # already cached under another key
          return
        node = self._next_node
        self._next_node += 1
        self.key_of[page], self.page_of[key] = key, page
        self.node_of[page], self.node_page[node] = node, page
      chain.parent = self.node_of[page]
      chain.blocks += 1
