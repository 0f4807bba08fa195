/*
 * superfluid.h — the superfluid executor ABI (docs/contract.md §1–§3, §7, §8).
 *
 * The one description of every record that crosses a process boundary. The
 * Python side compiles this file through cffi and reads its layout from the
 * compiler; a Rust, Go or C planner includes it and links sf_ring.c.
 *
 * Rules kept by every record:
 *   - fixed-width little-endian fields, explicit padding (_pad*), no bitfields;
 *   - every u64 sits at an offset that is a multiple of 8 and every record's
 *     size is a multiple of 8, so the layout is the same on every 64-bit and
 *     32-bit target (the asserts at the end pin it);
 *   - top-level records (TickPlan, TickEvents, OpEvents, QueueReset, WorkerNotice)
 *     begin with struct_size; PartialEmit has none (MsgHeader.record_bytes only);
 *   - enum-valued fields are u32 holding one of the SF_* constants below;
 *   - padding and _reserved fields: write 0; readers ignore them.
 * Sizes and versions: a reader takes a record only when MsgHeader.record_bytes and
 * its struct_size both equal its own sizeof; anything else is refused, never guessed
 * at (a plan: RejectBounds naming the field; the Python client drops an event it
 * cannot decode, logged). Any layout change bumps SF_ABI_VERSION, and
 * sf_segment_check refuses a segment of another version (SF_CONNECT_ABI). It
 * compares with the SF_ABI_VERSION of the header it was compiled with, not with
 * the one the client's code was written for: a client rebuilt from a newer
 * checkout connects and fails later (a v1 client's plans were StaleSession). So
 * a client pins the version it speaks where it is built, and fails to compile
 * against any other header:
 *     SF_STATIC_ASSERT(SF_ABI_VERSION == 2, "written for ABI v2: port it");
 * (C; client/rust/src/lib.rs and client/go/abi_version.go do the same).
 * Units, unless a comment says otherwise: times in ns (a *_ns stamp is
 * CLOCK_MONOTONIC, sf_monotonic_ns), sizes in bytes, token counts in tokens, ring
 * offsets and lengths in elements (4 bytes), a sequence's length in cells (1 token
 * = 1 cell).
 * "planner" = the external scheduler, "executor" = the Python worker,
 * "daemon" = the supervisor that owns the segment.
 */
#ifndef SUPERFLUID_H
#define SUPERFLUID_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- versions */

/* 2: MsgHeader.session, SegmentHeader.session_id, the connect functions,
 * StaleSession, QueueReset, LIST_LANES / RETIRE_LANES. A v1 planner reads
 * abi_version 2 at connect and refuses the segment. */
#define SF_ABI_VERSION 2
/* "SFLUIDV1" read as a little-endian u64: the first 8 bytes of a segment. */
#define SF_MAGIC 0x31564449554c4653
#define SF_CACHE_LINE 64
#define SF_MAX_TOP_LOGPROBS 20
/* Byte alignment of every span offset and of the arena itself. */
#define SF_ARENA_ALIGN 8
#define SF_RUNTIME_ID_BYTES 32
#define SF_NAME_BYTES 32
/* TickPlan.plan_seq lies in [0, SF_PLAN_SEQ_MAX]; a larger one is RejectBounds. */
#define SF_PLAN_SEQ_MAX 0x7fffffffffffffff
/* sf_session_begin: a header session count further than this above the
 * worker's own (WorkerCounters.session_id) was scribbled, not counted. */
#define SF_SESSION_LEAD_MAX 0x100000000
/* An error message quotes at most this many bytes of what it answers. */
#define SF_ECHO_BYTES 64

/* ------------------------------------------------- plan status (contract §3) */
/* TickEvents.status: the verdict on a whole plan. Anything but OK means the
 * plan changed nothing; TickEvents.message names the field (contract §3: the rules). */
#define SF_STATUS_OK 0
#define SF_STATUS_RejectIllegalCombination 1
#define SF_STATUS_RejectBudget 2
#define SF_STATUS_RejectBounds 3
#define SF_STATUS_RejectUnknownLane 4
#define SF_STATUS_RejectHostRules 5
#define SF_STATUS_RejectStaleNonce 6
#define SF_STATUS_RejectStaleSeed 7
#define SF_STATUS_RejectBadRefGeneration 8
#define SF_STATUS_NeedsReplan 9
#define SF_STATUS_Fatal 10  /* in-process only: a worker process exits (status 70) instead */
#define SF_STATUS_StaleSession 11  /* the plan is an earlier session's: not run */

/* ----------------------------------------- tick status of an applied plan */
#define SF_TICK_OK 0
#define SF_TICK_SHED 1         /* something was shed or evicted: TickEvents.shed */
#define SF_TICK_LANE_ERRORS 2  /* a lane faulted: TickEvents.faults (wins over SHED) */

/* -------------------------------------------------------- TickPlan.flags */
#define SF_PLAN_DRAIN 1          /* no admits; the planner is draining */
#define SF_PLAN_PARTIAL_EMITS 2  /* stream each sampled token as it comes */
#define SF_PLAN_FLAGS_ALL 3

/* ---------------------------------------- TickPlan.evictable_cache_classes */
#define SF_CACHE_RESIDENT_PREFIX_CLASS 1
#define SF_CACHE_CLASSES_ALL 1

/* ----------------------------------------------------- LaneAdmit.sampling */
#define SF_SAMPLING_GPU_GREEDY 0  /* argmax in the engine */
#define SF_SAMPLING_GPU_SAMPLE 1  /* counter-based draw in the engine */
#define SF_SAMPLING_HOST 2        /* raw row to the logits ring; the planner picks and commits */

/* ------------------------------------------------ SamplingParams.flags */
#define SF_PARAM_IGNORE_EOS 1  /* an eos id (DESCRIBE) does not finish the lane: it decodes on */
#define SF_PARAM_FLAGS_ALL 1

/* -------------------------- LaneAdmit.determinism_class, granted_class */
#define SF_CLASS_BEST_EFFORT 0
#define SF_CLASS_SEED_PATH_INVARIANT 1
#define SF_CLASS_DISTRIBUTION_EXACT 2

/* ---------------------------------------------------- AdmitResult.status */
#define SF_ADMIT_ADMITTED 1

/* ------------------------------------------------------- LaneEmit.finish */
/* A finished lane decodes no more (a decode of it is RejectIllegalCombination):
 * retire it. */
#define SF_FINISH_NONE 0     /* not finished: it may decode again */
#define SF_FINISH_EOS 1      /* sampled an eos id, emitted as its last token; never a HOST lane */
#define SF_FINISH_LENGTH 2   /* the sequence reached max_seq_len cells */
#define SF_FINISH_GRAMMAR 3  /* the grammar completed: only EOS could follow (EOS wins over it) */

/* ------------------------------------------------------- LaneFault.code */
#define SF_FAULT_OOM_TENTATIVE 1   /* the runtime ran out of cells */
#define SF_FAULT_INTERNAL 2        /* a runtime error that is the lane's */
#define SF_FAULT_GRAMMAR_OVERFLOW 3 /* the lane's grammar matcher failed (a mask or an accept) */
#define SF_FAULT_REF_SPAN_OOB 4    /* the emit did not fit the token ring */
#define SF_FAULT_INJECTED 5        /* op INJECT_FAULT, or a fault schedule's lane fault without a code */
#define SF_FAULT_NUMERIC 6         /* the lane's logits row was not finite: no token is drawn from it */
/* A logits row is not finite when it holds a NaN or +inf, or no finite value. LaneFault.detail has
 * this bit (1 << 63) set when the fault was injected (op INJECT_FAULT, a fault schedule); the rest
 * of detail is the code-specific value, as without it. */
#define SF_FAULT_DETAIL_INJECTED 0x8000000000000000

/* ----------------------------------------------- ShedEntry.kind, .reason */
#define SF_SHED_CACHE_EVICTION 1
#define SF_SHED_PREFILL_CHUNK 2
#define SF_SHED_REASON_NONE 0
#define SF_SHED_REASON_BUDGET 1     /* past prefill_token_budget */
#define SF_SHED_REASON_YIELD 2      /* yield_requested between steps */
#define SF_SHED_REASON_MEMORY 3     /* evicted to fit this plan */
#define SF_SHED_REASON_PRESSURE 4   /* evicted when the cache settled */
#define SF_SHED_REASON_TAKEOVER 5   /* a seed lease took the entry over */
#define SF_SHED_REASON_LOST 6       /* an import failed; the entry is gone */
#define SF_SHED_REASON_CLEARED 7    /* op CACHE_CLEAR */

/* ------------------------------------------------------ RingRef.ring_id */
#define SF_RING_NONE 0    /* "no reference": every field zero */
#define SF_RING_PROMPT 1  /* u32 tokens, planner writes */
#define SF_RING_TOKENS 2  /* u32 tokens, executor writes (emits) */
#define SF_RING_LOGITS 3  /* f32 logits rows, executor writes */

/* ------------------------------------------------ MsgHeader.kind (slots) */
#define SF_MSG_PLAN 1     /* TickPlan + arena, plan queue */
#define SF_MSG_EVENTS 2   /* TickEvents + arena, event queue */
#define SF_MSG_OP 3       /* msgpack map, op queue (record_bytes = 0) */
#define SF_MSG_OP_EVENTS 4 /* OpEvents + arena, event queue (ops done between ticks) */
#define SF_MSG_PARTIAL 5  /* PartialEmit, stream queue */
#define SF_MSG_WORKER 6   /* WorkerNotice, event queue (daemon: restart, give-up) */
#define SF_MSG_RESET 7    /* QueueReset, event queue (worker: a corrupted queue was reset) */

/* ----------------------------------------------------- op kinds (contract §7) */
#define SF_OP_DESCRIBE 1
#define SF_OP_LEASE_SEED 2
#define SF_OP_RELEASE_SEED 3
#define SF_OP_REGISTER_GRAMMAR 4
#define SF_OP_RELEASE_GRAMMAR 5
#define SF_OP_REGISTER_LOGIT_BIAS 6
#define SF_OP_RELEASE_LOGIT_BIAS 7
#define SF_OP_INSTALL_STRATEGY 8
#define SF_OP_EXPORT_ENTRY 9
#define SF_OP_IMPORT_STATE 10
#define SF_OP_INJECT_FAULT 11
#define SF_OP_CACHE_CLEAR 12
#define SF_OP_LIST_LANES 13
#define SF_OP_RETIRE_LANES 14
#define SF_OP_INSTALL_FAULTS 15
#define SF_OP_LIST_FAULTS 16
#define SF_OP_CLEAR_FAULTS 17

/* Ops. An op is a msgpack map in an SF_MSG_OP slot ("Wire rules"): "op" (the name, any case, or
 * the SF_OP_* code), "op_id" (u64, default 0; echoed in OpCompletion.op_id: give each op its own),
 * then its fields. Integer fields are msgpack ints, flags msgpack bools (not 0/1), text str,
 * blobs bin; keys not listed are ignored. The worker runs ops in queue order between ticks,
 * before the next plan (which sees their effect); their completions ride in that plan's
 * TickEvents.op_completions, or go out as SF_MSG_OP_EVENTS when no plan is queued (an idle worker
 * looks at the op queue every ~5 ms). A failure has handle = value = 0 and payload {"error": str}
 * (<= 256 bytes) and changes no executor state (expired leases may be swept, as at any tick).
 * Besides the statuses listed, any op may answer BadRequest (not a map; a field missing, of the
 * wrong type or out of range), UnknownOp, StaleSession, and Capacity (its completion fits no
 * event slot). Handles are > 0, from one counter per worker (leases and biases share it), never
 * reused; a new worker (new epoch) knows none. "Refused: fatal" below is in-process only: a worker
 * process whose runtime fails exits (status 70) and the daemon starts a new epoch. "payload" is the
 * msgpack map in OpCompletion.payload; no payload = an empty span.
 *
 * DESCRIBE  no fields. value = vocab_size; payload:
 *   {abi_version: SF_ABI_VERSION, worker_epoch, fault_injection: bool (INJECT_FAULT allowed),
 *    eos: [token ids] (sorted), specials: {token text: id} (the runtime's special tokens, e.g. a
 *    checkpoint's tokenizer.json added tokens marked special; may hold the eos ids; may be {}),
 *    runtime: {runtime_id: str (whole: RuntimeDesc.runtime_id holds its first 32 bytes),
 *      vocab_size, max_seq_len, max_batch, max_seqs, page, prefill_step_tokens: ints as in
 *      RuntimeDesc; truncate_partial, copy_shares_cells, takeover_preferred, engine_sampling,
 *      engine_draws, verify_batches, exact_only: bools, the SF_RT_* bits},
 *    parallel: {tp: int >= 1 (tensor-parallel degree: the rank processes that run the worker's
 *      model), nnodes: int >= 1, <= tp (the machines they span)}}. Not in RuntimeDesc; a client
 *      reads an absent parallel (an older worker) as {tp: 1, nnodes: 1}. The planner sees one
 *      worker at every degree: a lane's rows do not depend on tp (nor its tokens, nor any record).
 *   EOS: a GPU_GREEDY / GPU_SAMPLE lane that samples an eos id emits it as its last token and
 *   finishes (SF_FINISH_EOS) unless SF_PARAM_IGNORE_EOS. A HOST lane never finishes on EOS: the
 *   planner that commits an eos id ends the lane itself. Eos and specials ids are exempt from the
 *   repeat/presence/frequency penalties. No role beyond eos is reported (no bos, no pad: specials
 *   names ids by text only); the executor adds no token to a prompt: it runs what the planner wrote.
 * LEASE_SEED  tokens [u32] (required; non-empty, each < vocab_size), ttl_ticks u32 >= 1 (required),
 *   determinism_class u32 (default SF_CLASS_SEED_PATH_INVARIANT). Pins the cache entry with the
 *   longest usable prefix of tokens. handle = the lease, for LaneAdmit.seed_handle; value = tokens
 *   it covers (whole pages; on exact_only an entry's whole key). Its admit needs the same
 *   determinism_class and a prompt that starts with those tokens, and prefills from token_offset =
 *   value; the admit ends the lease. Unused, it expires once ttl_ticks more plans are accepted
 *   (then RejectStaleSeed). NoMatch: no entry shares a whole page (exact_only: a whole key) with
 *   tokens; Capacity: the lease table is full (1024 leases by default). On exact_only, decode
 *   feeds the last token prefill reaches and every decode_replay one, which a seed's state holds
 *   as prefill fed them: an admit's lease must cover at most len(prompt) - decode_replay - 1
 *   tokens (else RejectIllegalCombination naming seed_handle); lease that many.
 * RELEASE_SEED  handle u64 > 0 (required). Ends the lease, unpins its entry. handle = it.
 *   UnknownHandle: no such lease (released, used by an admit, or swept after it expired).
 * REGISTER_GRAMMAR  kind str (required): "json_schema" | "regex" | "lark" | "gbnf" | "choice";
 *   text str (required, except for choice): the JSON schema (as JSON text), the regex (whole
 *   output must match), or the Lark / GBNF grammar; choices [str] (required for choice, non-empty):
 *   the output is exactly one of them. Compiled by llguidance against the checkpoint's
 *   tokenizer.json; a JSON schema gets no free whitespace unless its own "x-guidance" asks for it.
 *   handle = the grammar, for LaneAdmit.grammar_handle; value = compile time in microseconds.
 *   BadRequest: a field, or a grammar the library refuses (its message); Unsupported: the runtime
 *   has no tokenizer (checked before the fields); Capacity: 1024 grammars are registered.
 *   An admit borrows it (contract §3 step 4; else RejectIllegalCombination): registered, named by
 *   one admit of the plan, not with HOST sampling, borrowed by no live lane (one retired in the
 *   same plan gives it back first), and its fresh matcher takes the prompt's last
 *   grammar_replay tokens (a re-admit after a restart: grammar_replay = tokens generated). The
 *   lane's rows are masked first (contract §5) on the engine's sampling path; its retire or fault
 *   gives the grammar back.
 * RELEASE_GRAMMAR  handle u64 > 0 (required). Unregisters it at once, borrowed or not: a lane
 *   admitted with it keeps its grammar to its end; later admits naming it are refused.
 *   handle = it. UnknownHandle: no such grammar.
 * REGISTER_LOGIT_BIAS  bias (required): a map {token id: value} or an array of [token id, value]
 *   pairs; ids < vocab_size, each once; values int or float with |value| <= FLT_MAX, or -inf to ban
 *   the token (NaN and +inf are refused); {} is allowed. Added to a row before the penalties (contract
 *   §5; not to a HOST lane's logits row, which is the model's own). handle = the bias, for
 *   LaneAdmit.logit_bias_handle (any number of lanes); value = entries.
 * RELEASE_LOGIT_BIAS  handle u64 > 0 (required). handle = it; lanes admitted with it keep it.
 *   UnknownHandle: no such bias.
 * INSTALL_STRATEGY  slot u32 1..8, kind "prompt_lookup", max_draft u32 1..64, ngram_min u32 1..8,
 *   ngram_max u32 ngram_min..8 (all required). Prompt-lookup drafting: a lane drafts the tokens that
 *   followed the latest earlier occurrence of its longest matching suffix n-gram, and the executor
 *   verifies the draft in one step, picking each row as a plain round would, so a drafting lane's
 *   tokens are bitwise those it would decode without drafts (its granted_class is what it would be
 *   without the strategy). value = the new cert_id. Installing a filled slot replaces its
 *   strategy (new cert_id); lanes admitted earlier keep theirs. An admit naming an empty slot is
 *   RejectIllegalCombination. A lane drafts only if GPU_GREEDY/GPU_SAMPLE with no grammar, logit
 *   bias or logprobs (else it is admitted with cert_id 0 and decodes plainly). Drafts take only
 *   cells the plan's memory check left spare: they never make a plan NeedsReplan nor fault a lane.
 *   Whether drafting pays is measured (decode seconds per token with and without, per strategy and
 *   batch size); where it does not, lanes decode plainly and drafting is probed again later.
 *   Unsupported: the runtime has no step_rows or cannot truncate to any length (exact_only).
 * EXPORT_ENTRY  handle (required: a seed lease), path str (optional; see op paths below),
 *   overwrite bool (default false). The lease's whole entry (all its tokens, not only the leased
 *   prefix) as a blob: the runtime's state wrapped with its runtime_id and tokens. value = blob
 *   bytes; payload {blob: bin}, or with path none: the worker writes the blob to a new file there
 *   (mode 0600); an existing one is replaced (by a rename) only with overwrite true. The lease stays.
 *   UnknownHandle; BadRequest: a bad path, or no path and a blob of more than about half an event
 *   slot (Queue.slot_bytes / 2); Unsupported: the runtime cannot export it; Refused: fatal.
 * IMPORT_STATE  tokens [u32] (required), ttl_ticks u32 >= 1 (required), determinism_class (as
 *   LEASE_SEED), and blob bin, or (when blob is absent) path str (see op paths below): a file of
 *   at most the runtime's largest export (Runtime.export_bytes_max, in its envelope), read whole.
 *   The blob: an EXPORT_ENTRY blob of the same runtime_id. tokens: a prefix of the tokens it holds,
 *   cut down to whole pages (at least one page) on a paged runtime, exactly them on exact_only, at
 *   most max_seq_len. handle = a seed lease on the imported sequence (an admit uses it as a
 *   LEASE_SEED lease); value = tokens it covers. BadRequest: any of that; Capacity: the lease table
 *   is full, or the runtime has no room for the sequence; Refused: fatal.
 * Op paths: a file in the worker's state directory (serve --state-dir; default
 *   $SUPERFLUID_SHM_DIR/superfluid.NAME.state, made mode 0700 by the daemon), named relative to it
 *   (folders inside it allowed) or by an absolute path inside it. The worker walks it component by
 *   component without following symlinks and opens it without blocking: a path that leaves the
 *   directory ('..', absolute elsewhere), a symlink, a FIFO, a device, a socket or a directory is
 *   BadRequest naming 'path', as is a file larger than the import cap (whatever its st_size says)
 *   and an export that would take the directory past its limit (serve --state-dir-bytes). An
 *   export is written whole to a temporary file (.sf-write.*) before it takes its name.
 *   An executor without a state directory (in process, by default) takes no paths.
 * INJECT_FAULT  lane_tag int (required), code (default SF_FAULT_INJECTED; one of SF_FAULT_*). The
 *   lane faults with that code (a LaneFault, detail SF_FAULT_DETAIL_INJECTED) the next time a plan
 *   decodes it. value = lane_tag. Refused: the worker runs without fault injection
 *   (SegmentHeader.fault_injection 0); NoMatch: no live lane with that tag.
 * INSTALL_FAULTS  rules [map] (required, may be empty), seed u64 (default 0). Replaces the
 *   worker's fault schedule (docs/faults.md; `serve --fault-schedule FILE` installs the same JSON
 *   object at every start of a worker). A rule is {when, what, times}: when one of {tick: N} (the
 *   worker's N-th accepted tick, N >= 1), {token: K, lane: TAG (optional)} (a lane about to take
 *   its K-th generated token, K >= 1), {op: NAME, nth: N} (the N-th op of that kind, counted from
 *   the install), {chance: P} (each accepted tick, with probability P in (0, 1], drawn from seed
 *   and the tick's number: the same seed gives the same faults); tick and chance rules may name a
 *   lane too. what one of {fault: CODE} (the lane faults with that SF_FAULT_* code or name,
 *   default INJECTED; tick and chance rules: the named lane, else every lane the plan decodes),
 *   {fatal: "prefill" | "decode"} (the runtime fails fatally at its next step of that phase: the
 *   worker exits 70), {capacity: "prefill" | "decode"} (the next step of that phase fails for lack
 *   of memory: its lanes fault OOM_TENTATIVE), {stall_ms: S, during: "prefill" | "decode"} (the
 *   next step of that phase first sleeps S ms, holding the worker as a hang would), {slow_ms: S,
 *   ticks: T} (every step of the next T accepted ticks takes S ms longer), {nan: true} (the lane's
 *   next logits row is NaN: its sampler faults it NUMERIC). A token rule's phase is decode; an op
 *   rule takes only fatal or stall_ms (the op fails or sleeps). times u32 >= 1: how often the rule
 *   fires (default 1; a chance rule without it: every time it draws; an op rule fires at the nth op
 *   and the times - 1 after it; a tick rule fires once and takes no times). Every fault a rule causes is
 *   reported as the real one is, with SF_FAULT_DETAIL_INJECTED in a LaneFault's detail; counted in
 *   the worker's faults_injected metric. value = rules installed. BadRequest naming the field
 *   (e.g. "rules[1].when.token"); Refused: no fault injection.
 * LIST_FAULTS  no fields. value = rules installed; payload {seed, rules: [{when, what, times,
 *   fired}]} (times absent: unlimited). Refused: no fault injection.
 * CLEAR_FAULTS  no fields. Drops every rule and whatever they armed. value = rules dropped.
 *   Refused: no fault injection.
 * CACHE_CLEAR  no fields. Drops every unpinned prefix-cache entry, in the pool and in host memory
 *   (leased ones stay). value = bytes freed in the pool; each pool entry dropped is a CACHE_EVICTION
 *   ShedEntry (reason CLEARED) in the next accepted tick's ShedReport. Refused: fatal.
 * LIST_LANES  after u64 (default 0), limit 1..1024 (default 256). The lanes held (live, and faulted
 *   not yet retired; whichever session admitted them) with tag > after, by tag, at most limit (fewer
 *   when the page would pass half an event slot). value = lanes held in all; payload {lanes: [{tag,
 *   prompt (tokens), generated (tokens), state: "prefilling" | "decoding" | "finished" | "faulted",
 *   session (the one that admitted it)}], more: bool}. Page on with after = the last tag.
 * RETIRE_LANES  tags [u64] (distinct; each live or faulted, else NoMatch) or all: true (with
 *   session u64: only the lanes that session admitted); publish bool (default false; true keeps
 *   each live lane's sequence as a cache entry, as LaneRetire.publish_to_cache). All or nothing,
 *   by the code a plan's retires run; evictions it causes are in the next accepted tick's
 *   ShedReport. value = lanes retired; payload {retired: [tags]} ({} past 1024 tags). BadRequest:
 *   tags with all, session without all; Refused: fatal.
 */

/* --------------------------------------------------- OpCompletion.status */
/* Which op answers which: the "ops" comment above. */
#define SF_OPST_OK 0
#define SF_OPST_BadRequest 1     /* not a msgpack map, or a field missing, of the wrong type or range */
#define SF_OPST_UnknownOp 2      /* "op" names no SF_OP_* (OpCompletion.op is then 0) */
#define SF_OPST_UnknownHandle 3  /* no such handle: RELEASE_*, EXPORT_ENTRY */
#define SF_OPST_Refused 4        /* fault ops without fault injection; in-process, a fatal error */
#define SF_OPST_Unsupported 5    /* not here: grammars (no tokenizer), strategies (no step_rows) */
#define SF_OPST_NoMatch 6        /* nothing to act on: no usable prefix (LEASE_SEED), no such lane */
#define SF_OPST_Capacity 7       /* a table or the pool is full, or the completion fits no event slot */
#define SF_OPST_StaleSession 8   /* an earlier session's op: not run (op 0; op_id if it could be read) */

/* ------------------------------------------------------ QueueReset.queue */
#define SF_QUEUE_PLAN 1
#define SF_QUEUE_EVENT 2
#define SF_QUEUE_OP 3
#define SF_QUEUE_STREAM 4

/* ---------------------------------------------- SegmentHeader.worker_state */
#define SF_WORKER_EMPTY 0     /* segment made, no worker yet */
#define SF_WORKER_STARTING 1  /* worker process started, loading the model */
#define SF_WORKER_READY 2     /* worker reads plans */
#define SF_WORKER_STOPPING 3  /* stop requested, draining */
#define SF_WORKER_STOPPED 4   /* exited cleanly */
#define SF_WORKER_DEAD 5      /* exited or killed; the daemon restarts it */
#define SF_WORKER_GAVE_UP 6   /* crash loop: the daemon will not restart it */

/* --------------------------------------------- RuntimeDesc.flags (contract §8) */
/* What the runtime can do (RuntimeDesc.flags; DESCRIBE's runtime bools say the same). */
#define SF_RT_TRUNCATE_PARTIAL 1    /* a sequence can be cut to any length (else to 0 or all of it) */
#define SF_RT_COPY_SHARES_CELLS 2   /* a copy shares full KV blocks with its source */
#define SF_RT_TAKEOVER_PREFERRED 4  /* a seed that continues an entry takes its sequence, not a copy */
#define SF_RT_ENGINE_SAMPLING 8     /* picks on the device (GPU_* lanes with no bias/penalty/logprobs) */
#define SF_RT_ENGINE_DRAWS 16       /* and draws non-greedy ones there too (else on the host) */
#define SF_RT_VERIFY_BATCHES 32     /* a step can return a row per fed token (draft verification) */
#define SF_RT_EXACT_ONLY 64         /* recurrent state: cache entries, seeds are exact lengths, not pages */

/* ------------------------------------------------------- wait results */
#define SF_WAIT_READY 0     /* the queue has what was waited for */
#define SF_WAIT_TIMEOUT 1   /* the timeout passed */
#define SF_WAIT_GONE 2      /* the worker epoch changed or the worker is down */
#define SF_WAIT_STOP 3      /* the daemon is shutting down (SegmentHeader.stop_requested) */
/* Longest single futex sleep, so a waiter sees a dead peer within it. */
#define SF_WAIT_SLICE_NS 20000000
/* How long a sleeper woken by sf_queue_heads_up (woken, nothing to read) spins
 * before it sleeps again: longer than a worker takes from a tick's last step to
 * its events (~0.1-1 ms), shorter than a tick. */
#define SF_HEADS_UP_SPIN_NS 2000000

/* ================================================================ records */

/* A run of elements in a data ring. All zero = no reference. */
typedef struct RingRef {
    uint32_t ring_id;     /* SF_RING_*; writer sets */
    uint32_t generation;  /* ring wraps before the write, low 32 bits */
    uint64_t offset;      /* first element, 0 <= offset < capacity */
    uint64_t len;         /* elements; offset + len <= capacity */
} RingRef;

/* A list of records in the arena that travels with a top-level record. */
typedef struct Span {
    uint32_t offset;  /* bytes from the arena start, multiple of SF_ARENA_ALIGN */
    uint32_t count;   /* records (bytes for message and payload spans) */
} Span;

/* Wire rules (every queue, every language):
 * - A slot is MsgHeader, then the record at SF_RECORD_OFFSET (record_bytes == its
 *   struct_size, exactly: see "Sizes and versions" at the top), then the arena at
 *   SF_ARENA_OFFSET(record_bytes), the next SF_ARENA_ALIGN boundary. arena_bytes is
 *   exact, not rounded: the end of the last span's bytes (0: no arena); a reader
 *   checks only that the arena fits the slot and each span lies inside it. The
 *   whole message fits the queue's slot_bytes (the daemon's choice: read it from
 *   the Queue header).
 * - A list is a Span into the arena: offset in bytes from the arena start
 *   (a multiple of SF_ARENA_ALIGN), count in records; an empty list is
 *   {0, 0}. Byte strings (message, payload) are spans of bytes.
 * - An op (SF_MSG_OP) has no record: record_bytes 0, the msgpack map right
 *   after the MsgHeader, arena_bytes its length (at most slot_bytes - 24).
 *   Its keys and every op's fields: the "ops" comment at the SF_OP_* constants.
 * - Plan queue: SF_MSG_PLAN. The worker frees a plan's slot once it has decoded
 *   it, before running it: up to n_slots plans may wait. Every plan it reads gets
 *   exactly one SF_MSG_EVENTS, in plan order, a refused one too (a plan that does
 *   not decode is answered with the plan_seq at record bytes 8..15, or 0).
 * - The event queue carries, in the order they were written:
 *   SF_MSG_EVENTS: one per plan read. Its op_completions answer the ops run just
 *     before that plan (a StaleSession answer carries none).
 *   SF_MSG_OP_EVENTS: completions of ops run while no plan was queued, of those
 *     that did not fit their TickEvents (right after it), and the StaleSession
 *     answers to an earlier session's ops (stamped with that session).
 *   SF_MSG_WORKER (the daemon, session 0, only while no worker runs): DEAD or
 *     GAVE_UP with the dead worker's epoch when one ends, STARTING with the new
 *     epoch before a restart (none before the first start; the daemon never sends
 *     STOPPED); left out when the queue is full (worker_epoch and worker_state in
 *     the header say the same). At a restart the daemon drops the plans and ops
 *     the dead worker had not read: no reply comes for them. Against the epoch E
 *     you talk to, a notice says your worker is gone when its worker_epoch > E
 *     (any state: a STARTING notice of E + 1 means E died), or == E with DEAD,
 *     GAVE_UP (or STOPPED); one of an epoch < E, or STARTING of E itself (the start
 *     of the worker you talk to), is history: drop it. Notices from before you
 *     connected wait on the event queue like any message: after sf_session_begin,
 *     read what is queued without waiting and judge each notice by that rule
 *     against the epoch sf_wait_ready returned (they are history unless your
 *     worker died since); earlier sessions' replies among them are dropped by
 *     their session (the Python and Go clients drain them at connect, the Rust
 *     client as it reads).
 *   SF_MSG_RESET (the worker, session 0, ahead of its unsent replies): it found a
 *     queue's counters impossible (only a wrong write to that queue's counters
 *     does that) and emptied it (tail = head); what that queue held is gone, and
 *     nothing is resent: the plans and ops in it never get a reply (a plan never
 *     read has none, contract §1.4), an event-queue reset drops replies to plans
 *     that did run (their lanes changed), a stream reset loses only partial emits
 *     (the TickEvents has every token). The worker's plan_seq check is unchanged:
 *     the session's last accepted plan_seq stays, so a plan sent later must still
 *     be above it (keep plan_seq growing; a plan the plan queue lost was never
 *     accepted). A client cannot tell from the QueueReset which unanswered plans
 *     ran: it stops waiting for them and, before resending, learns the lanes' state (LIST_LANES)
 *     or retires and re-admits them with replay as after a restart (contract §9).
 *     The Python, Rust and Go clients record it (queue_resets) and resend nothing.
 *   A TickEvents or OpEvents whose worker_epoch is below the worker's you talk to
 *   is a dead worker's answer: drop it.
 * - Stream queue: SF_MSG_PARTIAL, only for plans with SF_PLAN_PARTIAL_EMITS, a
 *   token as it is sampled. The worker waits up to 1 s for room once per tick,
 *   then drops what does not fit; the plan's TickEvents still has every token.
 * - Waits: after sending, spin about 200 us (spin_ns 200000: a peer's turnaround),
 *   then sleep on the futex; idle, spin 0. Spin only while that queue's recent waits
 *   typically ended within about twice the spin: a wait that usually outlasts it
 *   (ticks of milliseconds) sleeps at once, leaving the core to the worker's threads;
 *   an empty tick is answered while spinning. The rule (SpinBudget in the Python,
 *   Rust and Go clients), per queue and direction, in signed 64-bit ns:
 *     1. keep budget = 200000 and typical = 0;
 *     2. before a wait: spin_ns = budget if typical <= 2 * budget, else 0;
 *     3. time the whole sf_queue_wait_* call with sf_monotonic_ns: took = after - before;
 *     4. clamp took to [0, 4 * budget] (a long idle spell counts as 4 budgets);
 *     5. typical += (took - typical) >> 3 (an arithmetic shift: floor of 1/8).
 *   watch_stop: planners pass 0 (the Python, Rust and Go clients do): a daemon that
 *   shuts down stops its workers, and the wait then says SF_WAIT_GONE; 1 ends the
 *   wait at the daemon's first word of it (stop_requested: SF_WAIT_STOP), for a
 *   caller that would rather not wait out the worker's last replies.
 *   The worker spins so for the next plan after each tick, and sleeps (spin 0) once
 *   a 5 ms slice passes with no plan. Heads-up: once a tick's model steps are done, the
 *   worker wakes a planner asleep on the event queue (sf_queue_heads_up, nothing
 *   published), and the wait spins up to SF_HEADS_UP_SPIN_NS for the events it is
 *   building: a wake-up from sleep costs 50-100 us on a VM and at times milliseconds,
 *   spent there while the worker works instead of after it has published. Any client
 *   waiting with sf_queue_wait_* gets this; one with its own wait loop should spin
 *   when woken with nothing to read. sf_queue_wait_* sleep in slices of SF_WAIT_SLICE_NS and,
 *   given the segment, return SF_WAIT_GONE once the worker is gone, so even a wait
 *   with no deadline ends. A tick can take seconds (a long prefill): time a reply out in seconds
 *   (the Python client's default is 30 s). Every timeout is in ns in C (< 0:
 *   none), seconds in Python.
 */

/* Leads every queue slot. The record starts right after it (SF_RECORD_OFFSET);
 * the arena at the next SF_ARENA_ALIGN boundary after the record. */
#define SF_RECORD_OFFSET 24
#define SF_ARENA_OFFSET(rb) (SF_RECORD_OFFSET + ((uint64_t)(rb) + SF_ARENA_ALIGN - 1) / SF_ARENA_ALIGN * SF_ARENA_ALIGN)
typedef struct MsgHeader {
    uint32_t kind;          /* SF_MSG_*; producer sets */
    uint32_t record_bytes;  /* bytes of the record (its struct_size); 0 for SF_MSG_OP */
    uint64_t arena_bytes;   /* bytes of the arena (the msgpack body for SF_MSG_OP) */
    uint64_t session;       /* plans, ops: the sender's; replies: exactly the one answered; notices: 0 */
} MsgHeader;

/* contract §5 parameters of a lane; planner sets, fixed for the lane's life. */
typedef struct SamplingParams {
    float temperature;       /* <= 0: greedy; finite */
    uint32_t top_k;          /* 0 = off */
    float top_p;             /* nucleus mass in (0, 1); 0 or >= 1 = off; >= 0 */
    float min_p;             /* in [0, 1]; 0 = off */
    float repeat_penalty;    /* >= 0; 0 or 1 = off */
    float presence_penalty;  /* 0 = off; finite */
    float freq_penalty;      /* 0 = off; finite */
    uint32_t flags;          /* SF_PARAM_* */
} SamplingParams;

/* Start a lane. Planner writes; executor answers with one AdmitResult. */
typedef struct LaneAdmit {
    uint64_t lane_tag;           /* planner's id of the lane: != 0, unique among live lanes */
    RingRef prompt;              /* prompt tokens, SF_RING_PROMPT */
    uint32_t sampling;           /* SF_SAMPLING_* */
    uint32_t decode_replay;      /* tokens: prompt tail fed as decode rounds, not emitted; < len(prompt) */
    SamplingParams params;       /* how tokens are picked */
    uint64_t rng_counter_base;   /* draw position of the lane's first sampled token; +1 a token */
    uint64_t grammar_handle;     /* op REGISTER_GRAMMAR handle; 0 = none */
    uint64_t logit_bias_handle;  /* op REGISTER_LOGIT_BIAS handle; 0 = none */
    uint64_t seed_handle;        /* op LEASE_SEED handle; 0 = none */
    uint32_t strategy_slot;      /* op INSTALL_STRATEGY slot; 0 = none */
    uint32_t grammar_replay;     /* tokens: prompt tail the grammar cursor replays; 0 without a grammar */
    uint32_t determinism_class;  /* SF_CLASS_* asked for */
    uint32_t want_logprobs;      /* 0 = none; n = chosen + (n-1) alternatives, n <= SF_MAX_TOP_LOGPROBS */
} LaneAdmit;

/* Feed prompt tokens [token_offset, token_offset + token_count) of a lane. */
typedef struct LanePrefill {
    uint64_t lane_tag;  /* live lane, or admitted in this plan */
    uint32_t token_offset;  /* tokens; must equal those prefilled so far (a seeded lane: the lease's value) */
    uint32_t token_count;   /* tokens past prefill_token_budget are shed, not an error */
} LanePrefill;

/* Grant a lane decode rounds this tick. */
typedef struct LaneDecode {
    uint64_t lane_tag;  /* live lane, or admitted in this plan; not finished */
    uint16_t max_new_tokens;  /* tokens (rounds) granted; replayed tokens count; HOST lanes: 1 */
    uint16_t overshoot;       /* tokens a verified draft may take past max_new_tokens (drafting lanes) */
    uint32_t _pad0;
} LaneDecode;

/* A host-sampled token for a HOST lane's pending logits row. */
typedef struct LaneCommit {
    uint64_t lane_tag;  /* a HOST lane with a pending logits row */
    uint32_t token_id;      /* < vocab_size */
    uint32_t _pad0;
    uint64_t logits_nonce;  /* LaneEmit.logits_nonce of the row it answers */
} LaneCommit;

/* End a lane (live, or faulted and not yet retired). */
typedef struct LaneRetire {
    uint64_t lane_tag;  /* live lane, or faulted and not yet retired */
    uint8_t publish_to_cache;  /* 0 or 1: keep the sequence as a prefix-cache entry */
    uint8_t _pad0[7];
} LaneRetire;

/* Reserved: the executor calls no pointer from a plan (across processes it is cleared; in
 * process, partial emits go to Executor.partial_sink and, across processes, the stream queue). */
typedef void (*sf_partial_emit_fn)(void *user, uint64_t lane_tag, const uint32_t *tokens, uint32_t n);

/* One tick's plan. Planner writes it into a plan-queue slot (SF_MSG_PLAN). */
typedef struct TickPlan {
    uint64_t struct_size;              /* sizeof(TickPlan) */
    uint64_t plan_seq;                 /* <= SF_PLAN_SEQ_MAX; above the session's last accepted */
    uint32_t flags;                    /* SF_PLAN_* */
    uint32_t max_decode_lanes;         /* lanes; <= max_batch; decodes <= this */
    uint32_t prefill_token_budget;     /* tokens: prompt tokens this tick may prefill, over all prefills */
    uint32_t evictable_cache_classes;  /* SF_CACHE_* the memory check may evict */
    uint64_t max_evict_bytes;          /* bytes: at most this much evicted this tick */
    uint64_t protected_quota_bytes;    /* bytes: never evict the resident cache below this */
    Span admits;                       /* LaneAdmit[] */
    Span prefills;                     /* LanePrefill[], run in this order */
    Span decodes;                      /* LaneDecode[] */
    Span commits;                      /* LaneCommit[], applied before everything but retires */
    Span retires;                      /* LaneRetire[] */
    uint64_t on_partial_emit;          /* reserved (sf_partial_emit_fn); never called */
    uint64_t partial_emit_user;        /* its user pointer */
} TickPlan;

/* ------------------------------------------------------------ events */

typedef struct AdmitResult {
    uint64_t lane_tag;  /* the admitted lane */
    uint32_t status;         /* SF_ADMIT_* */
    uint32_t reject_code;    /* 0 (a plan with a bad admit is rejected whole) */
    uint32_t cert_id;        /* INSTALL_STRATEGY cert_id of the strategy the lane drafts with; 0 = none */
    uint32_t granted_class;  /* SF_CLASS_* the executor promises */
} AdmitResult;

typedef struct SpecStats {
    uint32_t proposed;           /* draft tokens verified this tick */
    uint32_t accepted;           /* of which the lane took (each is one of its emitted tokens) */
    uint32_t cert_id_in_effect;  /* the lane's cert_id if drafting was on for it this tick; 0 = off */
    uint32_t _pad0;
} SpecStats;

/* What one decoding lane produced this tick. Executor writes. */
typedef struct LaneEmit {
    uint64_t lane_tag;  /* a lane decoded this tick */
    RingRef token_ref;      /* emitted u32 tokens, SF_RING_TOKENS (not replayed ones); none for HOST lanes */
    uint32_t n_tokens;      /* == token_ref.len */
    uint32_t finish;        /* SF_FINISH_* */
    RingRef logits_row;     /* HOST lanes: the model's raw f32 row, SF_RING_LOGITS, vocab_size long */
    uint64_t logits_nonce;  /* HOST lanes: commit with this; 0 otherwise */
    SpecStats spec;         /* drafting this tick */
} LaneEmit;

typedef struct LaneFault {
    uint64_t lane_tag;  /* the faulted lane; its sequence is freed, retire it */
    uint32_t code;    /* SF_FAULT_* */
    uint32_t _pad0;
    uint64_t detail;  /* code-specific: the runtime's fault code, or 0 */
} LaneFault;

typedef struct ShedEntry {
    uint64_t lane_tag;  /* 0 = a cache entry */
    uint32_t kind;      /* SF_SHED_* */
    uint32_t reason;    /* SF_SHED_REASON_* */
    uint64_t bytes;     /* bytes freed (evictions) */
    uint64_t tokens;    /* tokens dropped (chunks) or held by the entry (evictions) */
} ShedEntry;

/* Counters reconcile with the entries: chunks == #PREFILL_CHUNK entries,
 * evictions == #CACHE_EVICTION entries, bytes_evicted == their bytes. */
typedef struct ShedReport {
    uint32_t prefill_chunks_dropped;  /* PREFILL_CHUNK entries */
    uint32_t evictions_performed;  /* CACHE_EVICTION entries */
    uint64_t bytes_evicted;  /* sum of their bytes */
    Span entries;  /* ShedEntry[] */
} ShedReport;

typedef struct OpCompletion {
    uint64_t op_id;    /* the op's op_id */
    uint32_t status;   /* SF_OPST_* */
    uint32_t op;       /* SF_OP_* (0 when the op could not be read) */
    uint64_t handle;   /* the handle issued, released or exported (the "ops" comment); else 0 */
    uint64_t value;    /* op-specific count (e.g. tokens leased, bytes exported); 0 on failure */
    Span payload;      /* bytes: a msgpack map (DESCRIBE, EXPORT_ENTRY, *_LANES, {error}); or empty */
} OpCompletion;

typedef struct TickTimings {
    uint64_t wall_ns;  /* ns: whole tick, check included */
    uint64_t prefill_ns;  /* ns: prefill steps */
    uint64_t decode_ns;  /* ns: decode rounds */
    uint32_t graph_hits;  /* captured-graph replays (GPU backends; 0 today) */
    uint32_t graph_misses;  /* steps with no captured graph (0 today) */
} TickTimings;

typedef struct TickMemCounters {
    uint64_t allocated_bytes;       /* runtime memory held */
    uint64_t host_retained_bytes;   /* cache entries exported to host memory */
    uint64_t pool_blocks_total;  /* KV blocks of `page` cells in the pool */
    uint64_t pool_blocks_used;  /* of which held by sequences */
    uint64_t pool_bytes_evictable;  /* unpinned cache entries */
    uint64_t tentative_bytes;  /* reserved for in-flight work; 0 between ticks */
} TickMemCounters;

/* Log-probabilities of one emitted token (want_logprobs > 0). */
typedef struct LaneLogprob {
    uint64_t lane_tag;  /* the emitting lane */
    uint32_t token_id;  /* the chosen token */
    float logprob;      /* of the chosen token, after bias and penalties */
    uint32_t n_top;     /* alternatives filled, <= SF_MAX_TOP_LOGPROBS */
    uint32_t index;     /* which of the lane's tokens this tick, from 0 */
    uint32_t top_ids[SF_MAX_TOP_LOGPROBS];  /* alternatives, most likely first; n_top filled */
    float top_logprobs[SF_MAX_TOP_LOGPROBS];  /* their log-probabilities */
} LaneLogprob;

/* One tick's outcome. Executor writes it into an event-queue slot. */
typedef struct TickEvents {
    uint64_t struct_size;   /* sizeof(TickEvents) */
    uint64_t plan_seq;      /* of the plan this answers */
    uint32_t status;        /* SF_STATUS_*: OK, or why the plan changed nothing */
    uint32_t tick_status;   /* SF_TICK_* (status OK only) */
    Span admit_results;     /* AdmitResult[] */
    Span emits;             /* LaneEmit[] */
    Span faults;            /* LaneFault[] */
    ShedReport shed;        /* what was dropped or evicted */
    Span op_completions;    /* OpCompletion[] */
    Span logprobs;          /* LaneLogprob[] */
    Span message;           /* UTF-8 bytes: why rejected, naming the field; empty when OK */
    TickTimings timings;    /* where the tick's time went */
    TickMemCounters mem;    /* memory after the tick */
    uint64_t worker_epoch;  /* epoch of the worker that ran the tick */
} TickEvents;

/* Op completions no TickEvents carries (SF_MSG_OP_EVENTS; "Wire rules" says which). */
typedef struct OpEvents {
    uint64_t struct_size;   /* sizeof(OpEvents) */
    uint64_t worker_epoch;  /* epoch of the worker that ran the ops */
    Span op_completions;    /* OpCompletion[] */
} OpEvents;

/* The worker found a queue's counters impossible (head - tail > n_slots, or
 * tail past head) and reset it (tail = head): what it found and dropped. */
typedef struct QueueReset {
    uint64_t struct_size;   /* sizeof(QueueReset) */
    uint64_t worker_epoch;  /* the worker that reset it */
    uint32_t queue;         /* SF_QUEUE_* */
    uint32_t _pad0;
    uint64_t head;          /* the counters found (slots) */
    uint64_t tail;          /* the counters found (slots) */
    uint64_t reset_to;      /* both counters now */
} QueueReset;

/* A token as it is sampled (SF_MSG_PARTIAL, stream queue). */
typedef struct PartialEmit {
    uint64_t plan_seq;  /* the tick it belongs to */
    uint64_t lane_tag;  /* the emitting lane */
    uint32_t token_id;  /* the sampled token */
    uint32_t index;  /* which of the lane's tokens this tick, from 0 */
} PartialEmit;

/* The daemon's word on a worker (SF_MSG_WORKER). */
typedef struct WorkerNotice {
    uint64_t struct_size;   /* sizeof(WorkerNotice) */
    uint64_t worker_epoch;  /* DEAD, GAVE_UP: the dead worker's epoch; STARTING: the new one */
    uint32_t worker_state;  /* SF_WORKER_* */
    int32_t exit_status;    /* how the last worker ended: exit code (70: fatal runtime error), or -signal */
    uint32_t restarts;      /* restarts so far */
    uint32_t _pad0;
} WorkerNotice;

/* contract §8: what the runtime under the executor can do. The worker writes it when it
 * starts (and puts it back if overwritten); DESCRIBE reports the same and more. */
typedef struct RuntimeDesc {
    char runtime_id[SF_RUNTIME_ID_BYTES];  /* NUL-padded UTF-8, cut to 32 bytes (DESCRIBE: whole) */
    uint32_t vocab_size;  /* token ids are < vocab_size; logits rows are this long */
    uint32_t max_batch;            /* lanes per step; TickPlan.max_decode_lanes <= this */
    uint64_t max_seq_len;          /* cells (tokens) per sequence: a longer prompt is RejectBudget */
    uint32_t max_seqs;             /* sequences at once; 0 = unbounded */
    uint32_t page;                 /* cells per KV block; seeds and cache entries are whole pages */
    uint32_t prefill_step_tokens;  /* tokens per prefill step; 0 = one step */
    uint32_t flags;                /* SF_RT_* */
} RuntimeDesc;

/* ============================================================ transport */

/* SPSC queue of fixed slots; the slots follow this header in memory. */
typedef struct Queue {
    uint64_t head;  /* slots published; producer writes (release), its low 32 bits are the consumer's futex */
    uint8_t _pad0[SF_CACHE_LINE - 8];
    uint64_t tail;  /* slots released; consumer writes (release), its low 32 bits are the producer's futex */
    uint8_t _pad1[SF_CACHE_LINE - 8];
    uint32_t consumer_sleeping;  /* consumer sets before sleeping on head */
    uint32_t producer_sleeping;  /* producer sets before sleeping on tail */
    uint32_t n_slots;            /* power of two; set at creation */
    uint32_t slot_bytes;         /* bytes per slot incl. MsgHeader, multiple of 64 */
    uint8_t _pad2[SF_CACHE_LINE - 16];
} Queue;

/* A data ring of 4-byte elements; the elements follow this header. */
typedef struct DataRing {
    uint64_t head;     /* elements written ever (incl. skipped tails); writer stores release */
    uint64_t reserve;  /* end of the write in progress; >= head; readers re-check it */
    uint8_t _pad0[SF_CACHE_LINE - 16];
    uint32_t ring_id;     /* SF_RING_* */
    uint32_t elem_bytes;  /* 4 */
    uint64_t capacity;    /* elements */
    uint8_t _pad1[SF_CACHE_LINE - 16];
} DataRing;

/* Byte offsets from the segment start of everything in it. */
typedef struct SegmentLayout {
    uint64_t plan_queue;  /* Queue of SF_MSG_PLAN, planner -> executor */
    uint64_t event_queue;  /* Queue of SF_MSG_EVENTS/OP_EVENTS/WORKER/RESET, executor -> planner */
    uint64_t op_queue;  /* Queue of SF_MSG_OP, planner -> executor */
    uint64_t stream_queue;  /* Queue of SF_MSG_PARTIAL, executor -> planner */
    uint64_t prompt_ring;  /* DataRing SF_RING_PROMPT */
    uint64_t token_ring;  /* DataRing SF_RING_TOKENS */
    uint64_t logits_ring;  /* DataRing SF_RING_LOGITS */
    uint64_t _reserved0;
} SegmentLayout;

/* Counters the worker keeps current for `superfluid status`. */
typedef struct WorkerCounters {
    uint64_t ticks;           /* plans applied */
    uint64_t rejects;         /* plans rejected */
    uint64_t last_plan_seq;  /* last plan_seq accepted in session_id below (0 before its first) */
    uint64_t live_lanes;  /* lanes admitted and not retired */
    uint64_t cache_entries;  /* prefix-cache entries */
    uint64_t cache_bytes;  /* their bytes in the pool */
    uint64_t tokens_emitted;  /* tokens emitted since the worker started */
    uint64_t last_fault_lane;  /* lane of the last LaneFault */
    uint32_t last_fault_code;  /* SF_FAULT_*, 0 = none yet */
    uint32_t _pad0;
    uint64_t heartbeat_ns;     /* CLOCK_MONOTONIC ns of the worker's last loop */
    uint64_t blocked_since_ns;  /* CLOCK_MONOTONIC ns since the worker waits for event-queue room; 0 = not */
    uint64_t session_id;     /* the session the worker serves (its last plan's) */
    uint64_t stale_messages;  /* plans and ops of earlier sessions answered stale */
    uint64_t queue_resets;   /* corrupted queues reset */
    uint64_t _reserved[2];
} WorkerCounters;

/* The first bytes of every segment. */
typedef struct SegmentHeader {
    /* line 0: identity; the daemon writes it once, before anyone opens the segment */
    uint64_t magic;           /* SF_MAGIC */
    uint32_t abi_version;     /* SF_ABI_VERSION */
    uint32_t header_bytes;    /* sizeof(SegmentHeader) */
    uint64_t segment_bytes;   /* bytes of the whole mapping */
    uint32_t owner_uid;       /* the daemon's uid; the file is mode 0600 */
    uint32_t worker_index;  /* which of the daemon's workers */
    char name[SF_NAME_BYTES];  /* daemon name, NUL-padded */
    /* line 1: worker life, a report to the planner: the daemon writes epoch and state
     * while no worker runs, the running worker rewrites them (a planner's writes here
     * mislead only itself) */
    uint64_t worker_epoch;    /* bumped by the daemon on every (re)start */
    uint32_t worker_state;    /* SF_WORKER_*; a futex word: woken on every change */
    uint32_t worker_pid;  /* worker writes at start */
    uint32_t daemon_pid;  /* daemon writes at creation */
    uint32_t restarts;  /* daemon counts worker restarts */
    int32_t last_exit_status; /* exit code, or -signal, of the last worker */
    uint32_t fault_injection; /* 1 = INJECT_FAULT allowed (the daemon's --fault-injection) */
    uint64_t state_changed_ns;  /* CLOCK_MONOTONIC ns of the last state change */
    uint8_t _pad1[SF_CACHE_LINE - 40];
    /* line 2: planner -> executor, read between prefill steps and decode rounds */
    uint32_t yield_requested;  /* 1 = end the tick at the next step boundary */
    uint8_t _pad2[SF_CACHE_LINE - 4];
    /* line 3: planner -> executor, latency-sensitive requests are waiting */
    uint32_t latency_wanted;  /* 1 = keep prefill steps short */
    uint8_t _pad3[SF_CACHE_LINE - 4];
    /* line 4: sessions, and the daemon's report that it is shutting down */
    uint64_t session_id;      /* the connected planner's session: sf_session_begin bumps it */
    uint32_t stop_requested;  /* daemon: 1 = shutting down (a report; workers take commands over a pipe) */
    uint8_t _pad4[SF_CACHE_LINE - 12];
    /* line 5: the worker writes it when ready */
    RuntimeDesc runtime;       /* worker writes when ready */
    /* line 6 */
    SegmentLayout layout;      /* daemon writes at creation */
    /* lines 7-8 */
    WorkerCounters counters;   /* worker keeps current */
} SegmentHeader;

/* =========================================================== sessions
 *
 * How a planner (any language) connects to a worker, contract §10:
 *
 * 1. Find it: the segment of worker I of daemon NAME is the file
 *    $SUPERFLUID_SHM_DIR/superfluid.NAME.I (default directory /dev/shm; NAME is
 *    1-31 of [A-Za-z0-9_.-], starting with a letter or digit; I in 0..65535, in
 *    decimal), mode 0600, owned by the daemon's user. It may not exist yet (a
 *    planner may start first): retry. Open it O_RDWR (refuse a symlink:
 *    O_NOFOLLOW), fstat it, map all of it MAP_SHARED.
 * 2. Check it: sf_segment_check(). SF_CONNECT_ABI means the segment speaks
 *    another SF_ABI_VERSION: refuse it, never guess at its layout.
 *    sf_segment_open() does steps 1 and 2 (and checks the name and index the
 *    header holds); sf_segment_close() undoes them.
 * 3. Take it: sf_session_lock(fd), an exclusive non-blocking flock on the
 *    file, held for as long as the planner drives the worker. The kernel
 *    drops it when the process dies. -SF_EWOULDBLOCK: another planner has it.
 * 4. Wait for READY: sf_wait_ready() sleeps on the worker_state futex (the
 *    daemon and the worker wake it on every change) and returns the epoch.
 * 5. Start a session: sf_session_begin() bumps SegmentHeader.session_id
 *    (past the worker's own session, so a count someone wound back never
 *    hands out a used id) and returns it. Stamp it in MsgHeader.session of
 *    every plan and op; the worker never serves an id below its current. The
 *    worker runs only messages of the header's session: a plan an earlier
 *    session left queued is answered StaleSession (its own session in the
 *    reply) without running, an op OpStatus StaleSession. Replies
 *    (SF_MSG_EVENTS, OP_EVENTS, PARTIAL) carry exactly the session they
 *    answer: one that is not yours is an earlier session's, drop it. Only
 *    notices (SF_MSG_WORKER, SF_MSG_RESET) carry 0: for whoever is there. plan_seq
 *    starts afresh in every session: the first plan may carry any value up
 *    to SF_PLAN_SEQ_MAX, the next ones must grow.
 * 6. Lanes an earlier session left are still live: op LIST_LANES shows them
 *    (with the session that admitted each), RETIRE_LANES ends them. A lane
 *    belongs to no session: any plan of the current session may decode,
 *    commit to or retire it, and RETIRE_LANES ends any (all: true, with no
 *    session, ends every held lane). An admit of a live tag rejects the whole
 *    plan: RejectIllegalCombination naming admits[i].lane_tag ("lane N is
 *    live"); a faulted, unretired tag may be admitted again. A client without
 *    msgpack cannot read LIST_LANES' payload, but
 *    WorkerCounters.live_lanes says how many are live, and the op
 *    {"op": 14, "all": true} is the fixed bytes 82 a2 6f 70 0e a3 61 6c 6c c3
 *    (its completion's value: lanes retired); or it keeps its tags apart from
 *    every earlier session's: (session & 0xffffffff) << 32 | n, as the Rust and
 *    Go clients do, which is safe only if earlier planners did the same.
 * 7. Watch the epoch: when worker_epoch changes, a wait says SF_WAIT_GONE, or
 *    an SF_MSG_WORKER says so ("Wire rules"), the worker is gone, and its lanes, host rows,
 *    leases and handles with it. sf_wait_ready with after_epoch = the old epoch
 *    waits for the next one; keep the session, keep plan_seq growing, and
 *    re-admit each lane with prompt + generated, decode_replay = generated,
 *    rng_counter_base = base + sampled (contract §9). It says SF_WAIT_GONE when no
 *    worker is coming: GAVE_UP (until the daemon is sent SIGHUP), STOPPED (the
 *    daemon shuts down: stop_requested), or the daemon is dead.
 * 8. A stale segment: the file outlives a daemon that was killed (until the next
 *    `serve` of that name replaces it), so sf_wait_ready on a segment just opened
 *    may say SF_WAIT_GONE at once. worker_state GAVE_UP: the daemon lives; keep
 *    the mapping and wait again later (SIGHUP restarts the worker). Otherwise
 *    (STOPPED, or daemon_pid gone) that file is finished: sf_session_unlock,
 *    sf_segment_close, and sf_segment_open the name again (with a timeout) to
 *    find the next daemon's new file; never unlink it (it is the daemon's).
 *
 * The header is the worker's and the daemon's report: identity (line 0), worker
 * life (line 1), stop_requested, runtime, layout and counters; what a planner
 * writes there is rewritten or ignored, and misleads only itself. A planner
 * writes only:
 *   yield_requested: nonzero = end the running tick at the next boundary between
 *     prefill steps or decode rounds (untaken prefill is shed, SF_SHED_REASON_YIELD);
 *     the worker never clears it: while it stays set, every tick stops at its first;
 *   latency_wanted: nonzero = keep prefill steps short (latency-sensitive work
 *     is waiting); clear it when there is none;
 *   session_id, only through sf_session_begin;
 *   its side of each queue and ring, only through the sf_queue_* / sf_ring_*
 *   functions: head and producer_sleeping of the plan and op queues, tail and
 *   consumer_sleeping of the event and stream queues, the prompt ring.
 */

/* sf_segment_check and sf_segment_open results. */
#define SF_CONNECT_OK 0
#define SF_CONNECT_SHORT 1   /* smaller than a SegmentHeader */
#define SF_CONNECT_MAGIC 2   /* not a superfluid segment (or its magic is not written yet) */
#define SF_CONNECT_ABI 3     /* another SF_ABI_VERSION (or header size) */
#define SF_CONNECT_SIZE 4    /* segment_bytes is not the mapping's size */
#define SF_CONNECT_OWNER 5   /* made by another user (the header's owner_uid, or the file's) */
#define SF_CONNECT_NAME 6    /* open: not a name or index a segment has, or the header names another */
#define SF_CONNECT_MISSING 7 /* open: no such file (yet) */
#define SF_CONNECT_FILE 8    /* open: a symlink, not a regular file, or a mode other than 0600 */
/* sf_session_lock: -SF_EWOULDBLOCK when another process holds the lock (Linux's
 * EWOULDBLOCK, which is EAGAIN). */
#define SF_EWOULDBLOCK 11

/* =========================================================== sf_ring.c */

/* Atomics on shared words. */
uint64_t sf_load_acquire_u64(const uint64_t *p);
void sf_store_release_u64(uint64_t *p, uint64_t v);
uint32_t sf_load_acquire_u32(const uint32_t *p);
void sf_store_release_u32(uint32_t *p, uint32_t v);
uint64_t sf_fetch_add_u64(uint64_t *p, uint64_t v);
uint64_t sf_monotonic_ns(void);

/* A segment opened and mapped by sf_segment_open (process-local, not on the wire). */
typedef struct SegmentMap {
    SegmentHeader *seg;  /* the mapping's first byte; NULL when not open */
    uint64_t bytes;      /* mapped bytes: the whole file */
    int32_t fd;          /* O_RDWR | O_CLOEXEC; sf_session_lock takes it; -1 when not open */
    uint32_t _pad0;
} SegmentMap;

/* Steps 1-2 of "sessions": open worker `index` of daemon `name`
 * ($SUPERFLUID_SHM_DIR, else /dev/shm), as rings/segment.py opens it: the name
 * and index checked, O_NOFOLLOW, fstat (a regular file of this user, mode 0600,
 * at least a header), map all of it, sf_segment_check, then the header's name and
 * worker_index. While the file is missing, short or has no magic yet, it retries
 * every SF_WAIT_SLICE_NS until timeout_ns has passed (< 0: no deadline; 0: one
 * try). SF_CONNECT_OK with *out filled; else an SF_CONNECT_* (the last try's), or
 * -errno, with out->seg NULL and out->fd -1. close: unmap and close the fd
 * (which drops the session lock); a closed or failed map may be closed again. */
int sf_segment_open(const char *name, uint32_t index, int64_t timeout_ns, SegmentMap *out);
void sf_segment_close(SegmentMap *m);

/* Connect (see "sessions" above). check: SF_CONNECT_*. lock: 0, -SF_EWOULDBLOCK
 * when another process holds it, else -errno; unlock: 0 or -errno.
 * wait_ready: SF_WAIT_READY with *epoch set once the worker is READY with an
 * epoch above `after_epoch` (0: any), SF_WAIT_TIMEOUT, or SF_WAIT_GONE when
 * the daemon gave up on the worker, stopped it, or is dead (daemon_pid).
 * timeout_ns < 0 = no deadline. session_begin: the new session id (never 0).
 * set_worker_state: store, stamp state_changed_ns, wake every waiter. */
int sf_segment_check(const SegmentHeader *seg, uint64_t mapped_bytes);
int sf_session_lock(int fd);
int sf_session_unlock(int fd);
int sf_wait_ready(const SegmentHeader *seg, uint64_t after_epoch, int64_t timeout_ns, uint64_t *epoch);
uint64_t sf_session_begin(SegmentHeader *seg);
void sf_set_worker_state(SegmentHeader *seg, uint32_t state);

/* Names of the constants, for logs and error messages in every language:
 * "RejectBudget", "UnknownHandle", "READY", "EVENTS", "LEASE_SEED", ...;
 * "unknown" for a value that is none of them. */
const char *sf_status_name(uint32_t status);
const char *sf_opst_name(uint32_t status);
const char *sf_worker_state_name(uint32_t state);
const char *sf_msg_kind_name(uint32_t kind);
const char *sf_op_name(uint32_t op);

/* Futex on a shared (not process-private) word. wait: 0 woken or value
 * differed, 1 timed out, -errno on error. timeout_ns < 0 = no timeout.
 * wake: waiters woken. */
int sf_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns);
int sf_futex_wake(uint32_t *addr, int32_t n);

/* A process-local view of a shared queue or ring. The geometry (slots,
 * capacity) is read and checked once, at attach, and kept here: what the
 * other side writes into the shared header later cannot move an index out
 * of the mapping. */
typedef struct QueueView {
    Queue *q;            /* the shared header */
    uint8_t *slots;  /* first slot */
    uint32_t n_slots;  /* checked power of two */
    uint32_t slot_bytes;  /* checked multiple of SF_CACHE_LINE */
} QueueView;

typedef struct RingView {
    DataRing *r;         /* the shared header */
    uint8_t *data;  /* first element */
    uint64_t capacity;  /* elements */
    uint32_t ring_id;  /* SF_RING_* */
    uint32_t elem_bytes;  /* 4 */
} RingView;

/* Queues. init writes a fresh header (the creator only); attach checks that
 * the header's geometry fits `bytes` of mapping: 0, or -1 when it does not.
 * attach_as takes the geometry from the caller (the worker, told it by the
 * daemon) and writes it back over whatever the header says.
 * sane: 1 when head - tail <= n_slots (a tail past its head is not);
 * reset: tail := head (the queue is empty), wakes both sides, returns the
 * value both counters now hold.
 * reserve/peek return NULL when full/empty; publish/release move the
 * counters by one slot and wake a sleeping peer: 0, or -1 (nothing moved)
 * when the queue is full/empty, i.e. nothing was reserved/peeked. */
void sf_queue_init(void *queue, uint32_t n_slots, uint32_t slot_bytes);
int sf_queue_attach(QueueView *v, void *queue, uint64_t bytes);
int sf_queue_attach_as(QueueView *v, void *queue, uint64_t bytes, uint32_t n_slots, uint32_t slot_bytes);
int sf_queue_sane(const QueueView *v);
uint64_t sf_queue_reset(QueueView *v);
uint64_t sf_queue_bytes(uint32_t n_slots, uint32_t slot_bytes);
uint8_t *sf_queue_try_reserve(QueueView *v);
int sf_queue_publish(QueueView *v);
uint8_t *sf_queue_try_peek(QueueView *v);
int sf_queue_release(QueueView *v);
uint64_t sf_queue_len(const QueueView *v);
/* Spin for spin_ns, then sleep on the futex in slices of at most
 * SF_WAIT_SLICE_NS, checking the segment before each (woken with nothing
 * there, e.g. by a heads-up: spin up to SF_HEADS_UP_SPIN_NS first): SF_WAIT_GONE when
 * seg->worker_epoch != epoch, the worker is STOPPED/DEAD/GAVE_UP, or it is
 * READY but its worker_pid no longer exists,
 * SF_WAIT_STOP when stop_requested is set and watch_stop. seg may be NULL.
 * timeout_ns < 0 waits with no deadline (still checking the segment). */
int sf_queue_wait_readable(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                           int64_t timeout_ns, int64_t spin_ns);
int sf_queue_wait_writable(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                           int64_t timeout_ns, int64_t spin_ns);
/* Wake every sleeper on the queue (after an epoch change or a stop). */
void sf_queue_wake_all(QueueView *v);
/* Producer side: a message is due soon. Wakes a consumer asleep in
 * sf_queue_wait_readable/peek (a futex wake, only if it is asleep; nothing
 * published), which then spins up to SF_HEADS_UP_SPIN_NS before it sleeps again. */
void sf_queue_heads_up(QueueView *v);
/* The same as slot indexes, for callers that keep their own slot table:
 * *_at return the index try_reserve/try_peek would give, or -1; wait_*
 * wait as above, then return the index, or -SF_WAIT_TIMEOUT/GONE/STOP. */
int64_t sf_queue_reserve_at(QueueView *v);
int64_t sf_queue_peek_at(QueueView *v);
int64_t sf_queue_wait_reserve(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                              int64_t timeout_ns, int64_t spin_ns);
int64_t sf_queue_wait_peek(QueueView *v, const SegmentHeader *seg, uint64_t epoch, int watch_stop,
                           int64_t timeout_ns, int64_t spin_ns);

/* Data rings of 4-byte elements. write: SF_STATUS_OK, or
 * SF_STATUS_RejectBounds when n exceeds the capacity. check/read:
 * SF_STATUS_OK, SF_STATUS_RejectBounds (another ring, outside the ring, dst
 * too small) or SF_STATUS_RejectBadRefGeneration (wrapped over, or not yet
 * written). read copies, then checks again that the writer did not reach
 * what it copied. A write never splits: one that does not fit before the
 * end starts the next generation at offset 0. */
void sf_ring_init(void *ring, uint32_t ring_id, uint64_t capacity);
int sf_ring_attach(RingView *v, void *ring, uint64_t bytes);
/* As sf_queue_attach_as: the caller's ring id and capacity, written back. */
int sf_ring_attach_as(RingView *v, void *ring, uint64_t bytes, uint32_t ring_id, uint64_t capacity);
uint64_t sf_ring_bytes(uint64_t capacity);
uint32_t sf_ring_write(RingView *v, const void *src, uint64_t n, RingRef *out);
uint32_t sf_ring_check(const RingView *v, const RingRef *ref);
uint32_t sf_ring_read(const RingView *v, const RingRef *ref, void *dst, uint64_t dst_elems);
/* Zero-copy writes: begin reserves n elements and returns where to write
 * them (NULL when n exceeds the capacity); commit publishes them. */
void *sf_ring_begin(RingView *v, uint64_t n, RingRef *out);
void sf_ring_commit(RingView *v);

/* ============================================================== asserts */

#if defined(__cplusplus)
#define SF_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define SF_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

SF_STATIC_ASSERT(sizeof(RingRef) == 24, "RingRef size");
SF_STATIC_ASSERT(sizeof(Span) == 8, "Span size");
SF_STATIC_ASSERT(sizeof(MsgHeader) == 24, "MsgHeader size");
SF_STATIC_ASSERT(SF_RECORD_OFFSET == sizeof(MsgHeader), "the record follows the MsgHeader");
SF_STATIC_ASSERT(SF_ARENA_OFFSET(1) == 32 && SF_ARENA_OFFSET(sizeof(TickPlan)) == 128, "SF_ARENA_OFFSET");
SF_STATIC_ASSERT(sizeof(SamplingParams) == 32, "SamplingParams size");
SF_STATIC_ASSERT(sizeof(LaneAdmit) == 120, "LaneAdmit size");
SF_STATIC_ASSERT(offsetof(LaneAdmit, prompt) == 8, "LaneAdmit.prompt");
SF_STATIC_ASSERT(offsetof(LaneAdmit, sampling) == 32, "LaneAdmit.sampling");
SF_STATIC_ASSERT(offsetof(LaneAdmit, params) == 40, "LaneAdmit.params");
SF_STATIC_ASSERT(offsetof(LaneAdmit, rng_counter_base) == 72, "LaneAdmit.rng_counter_base");
SF_STATIC_ASSERT(offsetof(LaneAdmit, seed_handle) == 96, "LaneAdmit.seed_handle");
SF_STATIC_ASSERT(offsetof(LaneAdmit, want_logprobs) == 116, "LaneAdmit.want_logprobs");
SF_STATIC_ASSERT(sizeof(LanePrefill) == 16, "LanePrefill size");
SF_STATIC_ASSERT(sizeof(LaneDecode) == 16, "LaneDecode size");
SF_STATIC_ASSERT(offsetof(LaneDecode, overshoot) == 10, "LaneDecode.overshoot");
SF_STATIC_ASSERT(sizeof(LaneCommit) == 24, "LaneCommit size");
SF_STATIC_ASSERT(offsetof(LaneCommit, logits_nonce) == 16, "LaneCommit.logits_nonce");
SF_STATIC_ASSERT(sizeof(LaneRetire) == 16, "LaneRetire size");
SF_STATIC_ASSERT(sizeof(TickPlan) == 104, "TickPlan size");
SF_STATIC_ASSERT(offsetof(TickPlan, plan_seq) == 8, "TickPlan.plan_seq");
SF_STATIC_ASSERT(offsetof(TickPlan, max_evict_bytes) == 32, "TickPlan.max_evict_bytes");
SF_STATIC_ASSERT(offsetof(TickPlan, admits) == 48, "TickPlan.admits");
SF_STATIC_ASSERT(offsetof(TickPlan, retires) == 80, "TickPlan.retires");
SF_STATIC_ASSERT(offsetof(TickPlan, on_partial_emit) == 88, "TickPlan.on_partial_emit");
SF_STATIC_ASSERT(sizeof(AdmitResult) == 24, "AdmitResult size");
SF_STATIC_ASSERT(sizeof(SpecStats) == 16, "SpecStats size");
SF_STATIC_ASSERT(sizeof(LaneEmit) == 88, "LaneEmit size");
SF_STATIC_ASSERT(offsetof(LaneEmit, logits_row) == 40, "LaneEmit.logits_row");
SF_STATIC_ASSERT(offsetof(LaneEmit, logits_nonce) == 64, "LaneEmit.logits_nonce");
SF_STATIC_ASSERT(sizeof(LaneFault) == 24, "LaneFault size");
SF_STATIC_ASSERT(sizeof(ShedEntry) == 32, "ShedEntry size");
SF_STATIC_ASSERT(sizeof(ShedReport) == 24, "ShedReport size");
SF_STATIC_ASSERT(sizeof(OpCompletion) == 40, "OpCompletion size");
SF_STATIC_ASSERT(sizeof(TickTimings) == 32, "TickTimings size");
SF_STATIC_ASSERT(sizeof(TickMemCounters) == 48, "TickMemCounters size");
SF_STATIC_ASSERT(sizeof(LaneLogprob) == 184, "LaneLogprob size");
SF_STATIC_ASSERT(offsetof(LaneLogprob, top_logprobs) == 104, "LaneLogprob.top_logprobs");
SF_STATIC_ASSERT(sizeof(TickEvents) == 184, "TickEvents size");
SF_STATIC_ASSERT(offsetof(TickEvents, shed) == 48, "TickEvents.shed");
SF_STATIC_ASSERT(offsetof(TickEvents, message) == 88, "TickEvents.message");
SF_STATIC_ASSERT(offsetof(TickEvents, timings) == 96, "TickEvents.timings");
SF_STATIC_ASSERT(offsetof(TickEvents, mem) == 128, "TickEvents.mem");
SF_STATIC_ASSERT(offsetof(TickEvents, worker_epoch) == 176, "TickEvents.worker_epoch");
SF_STATIC_ASSERT(sizeof(OpEvents) == 24, "OpEvents size");
SF_STATIC_ASSERT(sizeof(QueueReset) == 48, "QueueReset size");
SF_STATIC_ASSERT(sizeof(PartialEmit) == 24, "PartialEmit size");
SF_STATIC_ASSERT(sizeof(WorkerNotice) == 32, "WorkerNotice size");
SF_STATIC_ASSERT(sizeof(RuntimeDesc) == 64, "RuntimeDesc size");
SF_STATIC_ASSERT(sizeof(Queue) == 3 * SF_CACHE_LINE, "Queue size");
SF_STATIC_ASSERT(offsetof(Queue, tail) == SF_CACHE_LINE, "Queue.tail on its own line");
SF_STATIC_ASSERT(sizeof(DataRing) == 2 * SF_CACHE_LINE, "DataRing size");
SF_STATIC_ASSERT(sizeof(SegmentLayout) == 64, "SegmentLayout size");
SF_STATIC_ASSERT(sizeof(WorkerCounters) == 128, "WorkerCounters size");
SF_STATIC_ASSERT(offsetof(SegmentHeader, worker_epoch) == 1 * SF_CACHE_LINE, "SegmentHeader.worker_epoch line");
SF_STATIC_ASSERT(offsetof(SegmentHeader, yield_requested) == 2 * SF_CACHE_LINE, "SegmentHeader.yield_requested line");
SF_STATIC_ASSERT(offsetof(SegmentHeader, latency_wanted) == 3 * SF_CACHE_LINE, "SegmentHeader.latency_wanted line");
SF_STATIC_ASSERT(offsetof(SegmentHeader, session_id) == 4 * SF_CACHE_LINE, "SegmentHeader.session_id line");
SF_STATIC_ASSERT(offsetof(SegmentHeader, runtime) == 5 * SF_CACHE_LINE, "SegmentHeader.runtime line");
SF_STATIC_ASSERT(offsetof(SegmentHeader, layout) == 6 * SF_CACHE_LINE, "SegmentHeader.layout line");
SF_STATIC_ASSERT(sizeof(SegmentHeader) == 9 * SF_CACHE_LINE, "SegmentHeader size");

#ifdef __cplusplus
}
#endif

#endif /* SUPERFLUID_H */
