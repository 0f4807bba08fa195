"""contract §3 step 9: does the plan fit the pool's cells and sequence slots?

Cells are counted in whole pages, as the pool hands them out:
- each prefilled or decoded lane grows from what it holds (a seeded admit:
  the cells of its seed) to what it will hold;
- a seeded copy costs its cells where copies do not share them, else only
  the partial last page it copies; an import costs its seed, and, for a
  moment, the rest of the entry before it is cut back (one import at a time:
  admits run in turn, before any prefill grows);
- a takeover gives back the entry's cells past the seed; a publishing retire
  may feed its held-back token.
What does not fit may come, in this order, from checkpoints (the executor
made them on its own: they hold nothing a plan was promised), from the
cache's unpinned entries least recently used first and from this plan's
publishing retires (only where the plan allows RESIDENT_PREFIX_CLASS, up to
max_evict_bytes, never below protected_quota_bytes), and from taking seed
entries over. Else NeedsReplan: the count is exact, so a plan that fits is
never refused and one that does not is never applied. Drafts are not
counted: a drafting lane (speculation_decode.py) drafts only into cells no lane was
promised here, so speculation never makes a plan NeedsReplan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from superfluid.abi import CacheClass, Status
from superfluid.abi.plan_codec import PlanReject
from superfluid.abi.records import TickPlan
from superfluid.executor.cache import CacheEntry
from superfluid.executor.seeds import SeedUse

if TYPE_CHECKING:
    from superfluid.executor.executor import Executor

_RESIDENT_PREFIX = int(CacheClass.RESIDENT_PREFIX_CLASS)


def check_memory(ex: Executor, plan: TickPlan, reached: dict[int, int], rounds: dict[int, int],
                 seeds: dict[int, SeedUse]) -> tuple[list[CacheEntry], set[int], dict[int, int]]:
    """(entries to evict, retires that must not publish, each lane's cells at
    the end at most); sets each seed's path. Raises NeedsReplan."""
    if not (reached or rounds or seeds or plan.admits or plan.retires):
        # Nothing grows, is seeded, published or admitted: no cell is needed,
        # and a slot is short only where the runtime holds more than max_seqs.
        desc = ex.desc
        if not desc.max_seqs or ex.runtime.mem_counters().seqs <= desc.max_seqs:
            return [], set(), {}
    count = _Count(ex, plan, reached, rounds, seeds)
    needed, short = count.needed()
    got = count.room(needed, short)
    if got is None:
        got = count.room_by_takeovers()
    if got is None:
        raise count.reject(needed, short)
    victims, unpublished = got
    return victims, set(unpublished), count.cells_after()


class _Count:
    """One plan's cells and sequence slots: what it needs, and where room can come from."""

    def __init__(self, ex: Executor, plan: TickPlan, reached: dict[int, int], rounds: dict[int, int],
                 seeds: dict[int, SeedUse]) -> None:
        self.ex, self.plan, self.seeds = ex, plan, seeds
        self.rt, self.page, self.desc = ex.runtime, ex.page, ex.desc
        self.grow = self._grow(reached, rounds)
        page, pages = self.page, self.pages
        self.growth = sum((pages(after) - pages(held)) * page for held, after in self.grow.values())
        self._retires()
        self._seed_paths()
        mem = self.mem = self.rt.mem_counters()
        self.free = max(0, mem.cells_total - mem.cells_used)
        self.unseeded = sum(1 for a in plan.admits if a.lane_tag not in seeds)
        self.allowed = bool(plan.evictable_cache_classes & _RESIDENT_PREFIX)

    def pages(self, n: int) -> int:
        return -(-n // self.page)

    def _grow(self, reached: dict[int, int], rounds: dict[int, int]) -> dict[int, list[int]]:
        """Cells each lane holds before its prefill and after this tick."""
        lanes, seeds, rt = self.ex.lanes, self.seeds, self.rt
        grow: dict[int, list[int]] = {}

        def start(tag: int) -> list[int]:
            if tag not in grow:
                lane = lanes.get(tag)
                use = seeds.get(tag)
                h = rt.seq_len(lane.seq) if lane else (use.keep if use else 0)
                grow[tag] = [h, h]
            return grow[tag]

        for tag, done in reached.items():
            lane = lanes.get(tag)
            use = seeds.get(tag)
            before = lane.prefilled if lane else (use.n if use else 0)
            start(tag)[1] += done - before
        for tag, n in rounds.items():
            start(tag)[1] += n
        return grow

    def cells_after(self) -> dict[int, int]:
        return {tag: after for tag, (_, after) in self.grow.items()}

    def _retires(self) -> None:
        """The plan's live retires: those that publish (and the cell a held-back
        token may take), and the sequences the others free."""
        lanes, pages, page = self.ex.lanes, self.pages, self.page
        live_retires = [r for r in self.plan.retires if r.lane_tag in lanes]
        self.publishing = 0
        self.publishers: list[int] = []
        for r in live_retires:
            lane = lanes[r.lane_tag]
            if r.publish_to_cache:
                self.publishers.append(r.lane_tag)
                if lane.pending_input is not None:
                    held = self.rt.seq_len(lane.seq)
                    self.publishing += (pages(held + 1) - pages(held)) * page
        self.retired = [lanes[r.lane_tag].seq for r in live_retires if not r.publish_to_cache]

    def _seed_paths(self) -> None:
        """Each seed's default path."""
        for use in self.seeds.values():
            e = use.entry
            if use.lease.adopt:
                use.path = "adopt"
            elif not e.resident:
                use.path = "import"
            elif self.desc.takeover_preferred and _continues(use, self.page) and _can_take_over(self.ex, use):
                use.path = "takeover"
            else:
                use.path = "copy"

    def _seed_cost(self) -> tuple[int, int, int, int]:
        """(cells copies and imports take, the largest import's passing
        excess, cells takeovers and whole-prompt adoptions give back, new
        sequence slots)."""
        page, pages = self.page, self.pages
        taken = excess = relief = slots = 0
        for use in self.seeds.values():
            e = use.entry
            if use.path == "copy":
                taken += (use.keep % page and page) if self.desc.copy_shares_cells else pages(use.keep) * page
                slots += 1
            elif use.path == "import":
                taken += pages(use.keep) * page
                excess = max(excess, (pages(len(e.tokens)) - pages(use.keep)) * page)
                slots += 1
            elif use.path == "takeover":
                relief += (pages(len(e.tokens)) - pages(use.keep)) * page
            else:  # adopt: the bare sequence holds the seed; a whole-prompt seed drops its last cell
                relief += (pages(use.n) - pages(use.keep)) * page
        return taken, excess, relief, slots

    def needed(self) -> tuple[int, int]:
        """(cells the plan needs, sequence slots it is short) on the seeds' paths now."""
        taken, excess, relief, slots = self._seed_cost()
        needed = taken + max(self.growth, excess) + self.publishing - relief
        short = 0
        max_seqs = self.desc.max_seqs
        if max_seqs:
            short = max(0, self.unseeded + slots - (max_seqs + len(self.retired) - self.mem.seqs))
        return needed, short

    def fits(self, needed: int, short: int, victims: list[CacheEntry], unpublished: list[int]) -> bool:
        if len(victims) + len(unpublished) < short:
            return False
        if self.mem.cells_total == 0:
            return True
        lanes = self.ex.lanes
        gone = self.retired + [e.resident_seq() for e in victims] + [lanes[t].seq for t in unpublished]
        return self.free + (self.rt.cells_released(gone) if gone else 0) >= needed

    def room(self, needed: int, short: int) -> tuple[list[CacheEntry], list[int]] | None:
        """(entries to evict, retires not to publish) that make the plan fit, or None."""
        fits, cache, plan = self.fits, self.ex.cache, self.plan
        if fits(needed, short, [], []):
            return [], []
        checkpoints = [e for e in cache.lru() if e.checkpoint]
        picked, ok = cache.plan_evict(1 << 62, lambda p: fits(needed, short, p, []), checkpoints)
        if ok:
            return picked, []
        if not self.allowed:
            return None
        cap = min(plan.max_evict_bytes, max(0, cache.resident_bytes - plan.protected_quota_bytes))
        rest = [e for e in cache.lru() if not e.checkpoint]
        more, ok = cache.plan_evict(cap, lambda p: fits(needed, short, picked + p, []), rest)
        if ok:
            return picked + more, []
        # A retire's would-be entry counts as the newest in the cache.
        spent = sum(e.bytes for e in more)
        unpublished: list[int] = []
        for tag in self.publishers:
            b = self.ex.entry_bytes(self.ex.lanes[tag].ingested)
            if spent + b > cap:
                continue
            spent += b
            unpublished.append(tag)
            if fits(needed, short, picked + more, unpublished):
                return picked + more, unpublished
        return None

    def room_by_takeovers(self) -> tuple[list[CacheEntry], list[int]] | None:
        """room() once seed entries the plan's copies could take over are taken
        over instead; None (the paths as they were) if that does not fit either."""
        switched = [u for u in self.seeds.values() if u.path == "copy" and _can_take_over(self.ex, u)]
        for u in switched:
            u.path = "takeover"
        got = self.room(*self.needed()) if switched else None
        if got is None:
            for u in switched:
                u.path = "copy"
        return got

    def reject(self, needed: int, short: int) -> PlanReject:
        why = (f"the plan needs {needed} cells, {self.free} are free" if not self.fits(needed, 0, [], [])
               else f"{short} more sequence slots than max_seqs allows")
        if not self.allowed:
            return PlanReject(Status.NeedsReplan, "TickPlan.evictable_cache_classes",
                              f"{why}, and the plan allows no cache eviction")
        return PlanReject(Status.NeedsReplan, "TickPlan.max_evict_bytes",
                          f"{why}; evicting what the plan allows of the cache is not enough")


def _continues(use: SeedUse, page: int) -> bool:
    """Only a seed that keeps the entry's whole prompt (the next turn) takes
    it over by preference; a fork copies and leaves it for its siblings."""
    return use.keep >= use.entry.prompt_len // page * page


def _can_take_over(ex: Executor, use: SeedUse) -> bool:
    e = use.entry
    if use.lease.adopt or not e.resident or ex.desc.copy_shares_cells or e.pins != 1:
        return False
    cuttable = ex.desc.truncate_partial or len(e.tokens) == use.keep
    # On a recurrent runtime an entry a seed has copied from is kept for the next one.
    shared = ex.exact_only and e.seeded > 0
    return cuttable and not shared
