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
    rt, page, desc = ex.runtime, ex.page, ex.desc
    if not (reached or rounds or seeds or plan.admits or plan.retires):
        # Nothing grows, is seeded, published or admitted: no cell is needed,
        # and a slot is short only where the runtime holds more than max_seqs.
        if not desc.max_seqs or rt.mem_counters().seqs <= desc.max_seqs:
            return [], set(), {}

    def pages(n: int) -> int:
        return -(-n // page)

    # Cells each lane holds before its prefill and after this tick.
    grow: dict[int, list[int]] = {}

    def start(tag: int) -> list[int]:
        if tag not in grow:
            lane = ex.lanes.get(tag)
            use = seeds.get(tag)
            h = rt.seq_len(lane.seq) if lane else (use.keep if use else 0)
            grow[tag] = [h, h]
        return grow[tag]

    for tag, done in reached.items():
        lane = ex.lanes.get(tag)
        use = seeds.get(tag)
        before = lane.prefilled if lane else (use.n if use else 0)
        start(tag)[1] += done - before
    for tag, n in rounds.items():
        start(tag)[1] += n
    growth = sum((pages(after) - pages(held)) * page for held, after in grow.values())

    live_retires = [r for r in plan.retires if r.lane_tag in ex.lanes]
    publishing = 0
    publishers = []
    for r in live_retires:
        lane = ex.lanes[r.lane_tag]
        if r.publish_to_cache:
            publishers.append(r.lane_tag)
            if lane.pending_input is not None:
                held = rt.seq_len(lane.seq)
                publishing += (pages(held + 1) - pages(held)) * page
    retired = [ex.lanes[r.lane_tag].seq for r in live_retires if not r.publish_to_cache]

    # Each seed's default path and what it costs.
    for use in seeds.values():
        e = use.entry
        if use.lease.adopt:
            use.path = "adopt"
        elif not e.resident:
            use.path = "import"
        elif desc.takeover_preferred and _continues(use, page) and _can_take_over(ex, use):
            use.path = "takeover"
        else:
            use.path = "copy"

    def seed_cost() -> tuple[int, int, int, int]:
        """(cells copies and imports take, the largest import's passing
        excess, cells takeovers and whole-prompt adoptions give back, new
        sequence slots)."""
        taken = excess = relief = slots = 0
        for use in seeds.values():
            e = use.entry
            if use.path == "copy":
                taken += (use.keep % page and page) if desc.copy_shares_cells else pages(use.keep) * page
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

    mem = rt.mem_counters()
    free = max(0, mem.cells_total - mem.cells_used)
    unseeded = sum(1 for a in plan.admits if a.lane_tag not in seeds)

    def verdict():
        taken, excess, relief, slots = seed_cost()
        needed = taken + max(growth, excess) + publishing - relief
        short = 0
        if desc.max_seqs:
            short = max(0, unseeded + slots - (desc.max_seqs + len(retired) - mem.seqs))
        return needed, short

    def fits(needed: int, short: int, victims: list[CacheEntry], unpublished: list[int]) -> bool:
        if len(victims) + len(unpublished) < short:
            return False
        if mem.cells_total == 0:
            return True
        gone = retired + [e.seq for e in victims] + [ex.lanes[t].seq for t in unpublished]
        return free + (rt.cells_released(gone) if gone else 0) >= needed

    cells_after = {tag: after for tag, (_, after) in grow.items()}
    allowed = bool(plan.evictable_cache_classes & _RESIDENT_PREFIX)

    def room(needed: int, short: int) -> tuple[list[CacheEntry], list[int]] | None:
        if fits(needed, short, [], []):
            return [], []
        checkpoints = [e for e in ex.cache.lru() if e.checkpoint]
        picked, ok = ex.cache.plan_evict(1 << 62, lambda p: fits(needed, short, p, []), checkpoints)
        if ok:
            return picked, []
        if not allowed:
            return None
        cap = min(plan.max_evict_bytes, max(0, ex.cache.resident_bytes - plan.protected_quota_bytes))
        rest = [e for e in ex.cache.lru() if not e.checkpoint]
        more, ok = ex.cache.plan_evict(cap, lambda p: fits(needed, short, picked + p, []), rest)
        if ok:
            return picked + more, []
        # A retire's would-be entry counts as the newest in the cache.
        spent = sum(e.bytes for e in more)
        unpublished: list[int] = []
        for tag in publishers:
            b = ex.entry_bytes(ex.lanes[tag].ingested)
            if spent + b > cap:
                continue
            spent += b
            unpublished.append(tag)
            if fits(needed, short, picked + more, unpublished):
                return picked + more, unpublished
        return None

    needed, short = verdict()
    got = room(needed, short)
    if got is None:
        # Seed entries the plan's copies could take over instead.
        switched = [u for u in seeds.values() if u.path == "copy" and _can_take_over(ex, u)]
        for u in switched:
            u.path = "takeover"
        if switched:
            needed2, short2 = verdict()
            got = room(needed2, short2)
        if got is None:
            for u in switched:
                u.path = "copy"
            why = (f"the plan needs {needed} cells, {free} are free" if not fits(needed, 0, [], [])
                   else f"{short} more sequence slots than max_seqs allows")
            if not allowed:
                raise PlanReject(Status.NeedsReplan, "TickPlan.evictable_cache_classes",
                                 f"{why}, and the plan allows no cache eviction")
            raise PlanReject(Status.NeedsReplan, "TickPlan.max_evict_bytes",
                             f"{why}; evicting what the plan allows of the cache is not enough")
    victims, unpublished = got
    return victims, set(unpublished), cells_after


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
