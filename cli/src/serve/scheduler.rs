//! The server's scheduling policy, apart from any model: which running sequence gets which
//! tokens in an engine step, and what each sequence's feeding state becomes after it.
//!
//! The [`Scheduler`] holds the running batch's slots. Each occupied slot carries a sequence's
//! scheduling state ([`SeqState`]: its id, prompt length, prompt tokens fed, next position,
//! the pending sampled token, whether it speculates) beside the caller's data for it (the
//! batcher's request, sampler and drafter). One step:
//!
//! 1. [`Scheduler::plan`] decides the step as plain data, a list of [`Work`] in slot order:
//!    prompt chunks that share the `--prefill-chunk` token budget in slot order (a long prompt
//!    spans several steps; a slot whose prompt gets no token of the budget waits for the next
//!    step), and for every sequence past its prompt its pending token, fed plainly
//!    ([`Work::Decode`]) or as the root of a draft tree ([`Work::Speculate`]). Decode and
//!    speculation items take none of the budget and are always scheduled. Planning counts the
//!    prompt chunks and decode tokens as fed (their cells are in this step's batch).
//! 2. The caller runs the step and reports: [`Scheduler::sampled`] for the token drawn from a
//!    prompt's last logits or a decode token's, [`Scheduler::accepted`] for a tree's accepted
//!    path (its length advances the position; the walk's last token is the next root).
//! 3. Finished, failed and cancelled sequences leave with [`Scheduler::remove`]; a freed slot
//!    takes the next admitted sequence from position 0.
//!
//! Architecture invariant: this module knows no model, engine, batch or request type. The
//! batching loop ([`super::batcher`]) turns a plan into a batch and a forward; everything here
//! is tested without a model.
//!
//! The queue bound in front of admission (`--queue`, answered 429) is the request channel's
//! capacity ([`super::AppState::submit`]); the scheduler admits from it only into free slots.

use std::fmt;
use std::ops::Range;

use engine::runtime::SeqId;

/// A sequence's scheduling state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqState {
    /// The sequence id of its cache cells (its slot index).
    pub seq: SeqId,
    pub prompt_len: usize,
    /// Prompt tokens in the cache (or in the step being run).
    pub fed: usize,
    /// The position of the next token fed.
    pub pos: u32,
    /// The last sampled token, to be fed in the next step (a tree's root when speculating).
    pub next: Option<u32>,
    /// Whether its tokens after the prompt are fed as draft trees.
    pub speculates: bool,
    /// What the step in flight owes this sequence, if anything.
    pub awaiting: Option<Awaiting>,
}

/// What a planned step owes a sequence before it can be fed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Awaiting {
    /// A token sampled from the logits of its prompt's last token or of its decode token.
    Sample,
    /// The accepted path of its draft tree.
    Tree,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// Prompt tokens `range` at positions `pos0..`; logits for the last of them when it is the
    /// prompt's last token (then the sequence samples its first token from them).
    Prefill {
        slot: usize,
        seq: SeqId,
        range: Range<usize>,
        pos0: u32,
        logits_for_last: bool,
    },
    /// The pending token at `pos`, with logits.
    Decode {
        slot: usize,
        seq: SeqId,
        token: u32,
        pos: u32,
    },
    /// A draft tree whose root is the pending token `root`, at `pos`.
    Speculate {
        slot: usize,
        seq: SeqId,
        root: u32,
        pos: u32,
    },
}

impl Work {
    pub fn slot(&self) -> usize {
        match *self {
            Work::Prefill { slot, .. }
            | Work::Decode { slot, .. }
            | Work::Speculate { slot, .. } => slot,
        }
    }
}

/// Why a sequence was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdmitError {
    /// Every slot holds a sequence.
    Full { max_batch: usize },
    /// A prompt of no tokens (it would never produce logits to sample from).
    EmptyPrompt,
    /// A prompt longer than positions can count.
    PromptTooLong { len: usize },
}

impl fmt::Display for AdmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdmitError::Full { max_batch } => write!(
                f,
                "no free slot in the running batch: all {max_batch} slots hold a sequence"
            ),
            AdmitError::EmptyPrompt => {
                write!(f, "expected a prompt of at least one token, found none")
            }
            AdmitError::PromptTooLong { len } => write!(
                f,
                "expected a prompt of at most {} tokens, found {len}",
                u32::MAX
            ),
        }
    }
}

/// A report that does not match what the step planned for a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportError {
    /// The slot is past the batch.
    NoSlot { slot: usize, max_batch: usize },
    /// The slot holds no sequence.
    FreeSlot { slot: usize },
    /// The slot's step did not await what was reported.
    Unexpected {
        slot: usize,
        awaited: Option<Awaiting>,
        reported: Awaiting,
    },
    /// A tree path without its root.
    EmptyPath { slot: usize },
}

impl fmt::Display for ReportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = |a: Option<Awaiting>| match a {
            None => "nothing",
            Some(Awaiting::Sample) => "a sampled token",
            Some(Awaiting::Tree) => "a tree's accepted path",
        };
        match self {
            ReportError::NoSlot { slot, max_batch } => write!(
                f,
                "expected a sequence in slot {slot}, found no such slot (the batch has {max_batch})"
            ),
            ReportError::FreeSlot { slot } => {
                write!(f, "expected a sequence in slot {slot}, found a free slot")
            }
            ReportError::Unexpected {
                slot,
                awaited,
                reported,
            } => write!(
                f,
                "expected a report of {} for slot {slot}, found {}",
                what(*awaited),
                what(Some(*reported))
            ),
            ReportError::EmptyPath { slot } => write!(
                f,
                "expected an accepted path of at least the root for slot {slot}, found none"
            ),
        }
    }
}

struct Entry<T> {
    state: SeqState,
    data: T,
}

/// The running batch's slots and the policy that feeds them; `T` is the caller's data per
/// sequence.
pub struct Scheduler<T> {
    slots: Vec<Option<Entry<T>>>,
    /// Prompt tokens per step (at least 1).
    budget: usize,
}

impl<T> Scheduler<T> {
    /// `max_batch` slots; at most `prefill_chunk` prompt tokens per step (0 counts as 1).
    pub fn new(max_batch: usize, prefill_chunk: usize) -> Self {
        Scheduler {
            slots: (0..max_batch).map(|_| None).collect(),
            budget: prefill_chunk.max(1),
        }
    }

    /// The slot a prompt of `prompt_len` tokens would be admitted to (the first free one), or
    /// why it would be refused.
    pub fn check_admit(&self, prompt_len: usize) -> Result<usize, AdmitError> {
        if prompt_len == 0 {
            return Err(AdmitError::EmptyPrompt);
        }
        if u32::try_from(prompt_len).is_err() {
            return Err(AdmitError::PromptTooLong { len: prompt_len });
        }
        self.slots
            .iter()
            .position(Option::is_none)
            .ok_or(AdmitError::Full {
                max_batch: self.slots.len(),
            })
    }

    /// Admit a sequence into the first free slot, from position 0; returns the slot (its
    /// sequence id is the slot index). On refusal `data` comes back with the reason.
    pub fn admit(
        &mut self,
        prompt_len: usize,
        speculates: bool,
        data: T,
    ) -> Result<usize, (AdmitError, T)> {
        let slot = match self.check_admit(prompt_len) {
            Ok(s) => s,
            Err(e) => return Err((e, data)),
        };
        self.slots[slot] = Some(Entry {
            state: SeqState {
                seq: slot as SeqId,
                prompt_len,
                fed: 0,
                pos: 0,
                next: None,
                speculates,
                awaiting: None,
            },
            data,
        });
        Ok(slot)
    }

    /// Free `slot` (finished, failed or cancelled); its sequence id and data, if it held one.
    pub fn remove(&mut self, slot: usize) -> Option<(SeqId, T)> {
        let e = self.slots.get_mut(slot)?.take()?;
        Some((e.state.seq, e.data))
    }

    pub fn n_active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    pub fn has_free_slot(&self) -> bool {
        self.slots.iter().any(Option::is_none)
    }

    /// The occupied slots, in order.
    pub fn occupied(&self) -> impl Iterator<Item = (usize, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|e| (i, &e.data)))
    }

    pub fn get_mut(&mut self, slot: usize) -> Option<&mut T> {
        self.slots.get_mut(slot)?.as_mut().map(|e| &mut e.data)
    }

    /// The scheduling state of `slot` (the loop needs only plans; tests read it).
    #[cfg(test)]
    pub fn state(&self, slot: usize) -> Option<&SeqState> {
        self.slots.get(slot)?.as_ref().map(|e| &e.state)
    }

    /// This step's work, in slot order, counted as fed: each prompt chunk advances `fed` and
    /// `pos` by its length, a decode token advances `pos` by one, and a pending token leaves
    /// `next` (a tree's position advances when its accepted path is reported).
    pub fn plan(&mut self) -> Vec<Work> {
        let mut budget = self.budget;
        let mut work = Vec::new();
        for (slot, entry) in self.slots.iter_mut().enumerate() {
            let Some(Entry { state: s, .. }) = entry.as_mut() else {
                continue;
            };
            if s.fed < s.prompt_len {
                let n = (s.prompt_len - s.fed).min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                let range = s.fed..s.fed + n;
                let logits_for_last = range.end == s.prompt_len;
                work.push(Work::Prefill {
                    slot,
                    seq: s.seq,
                    range,
                    pos0: s.pos,
                    logits_for_last,
                });
                s.fed += n;
                // Prompt positions fit: admission refuses prompts past u32::MAX tokens.
                s.pos += n as u32;
                if logits_for_last {
                    s.awaiting = Some(Awaiting::Sample);
                }
            } else if let Some(token) = s.next.take() {
                if s.speculates {
                    work.push(Work::Speculate {
                        slot,
                        seq: s.seq,
                        root: token,
                        pos: s.pos,
                    });
                    s.awaiting = Some(Awaiting::Tree);
                } else {
                    work.push(Work::Decode {
                        slot,
                        seq: s.seq,
                        token,
                        pos: s.pos,
                    });
                    // Positions stay below the context the routes checked each request against.
                    s.pos += 1;
                    s.awaiting = Some(Awaiting::Sample);
                }
            }
        }
        work
    }

    fn awaiting(&mut self, slot: usize, reported: Awaiting) -> Result<&mut SeqState, ReportError> {
        let max_batch = self.slots.len();
        let s = match self.slots.get_mut(slot) {
            None => return Err(ReportError::NoSlot { slot, max_batch }),
            Some(None) => return Err(ReportError::FreeSlot { slot }),
            Some(Some(e)) => &mut e.state,
        };
        if s.awaiting != Some(reported) {
            return Err(ReportError::Unexpected {
                slot,
                awaited: s.awaiting,
                reported,
            });
        }
        Ok(s)
    }

    /// `token` was sampled for `slot` from this step's logits (its prompt's last token or its
    /// decode token): it is fed in the next step.
    pub fn sampled(&mut self, slot: usize, token: u32) -> Result<(), ReportError> {
        let s = self.awaiting(slot, Awaiting::Sample)?;
        s.awaiting = None;
        s.next = Some(token);
        Ok(())
    }

    /// `slot`'s tree kept an accepted path of `path_len` nodes (the root and each accepted
    /// child) and drew `next`, the next tree's root.
    pub fn accepted(&mut self, slot: usize, path_len: usize, next: u32) -> Result<(), ReportError> {
        if path_len == 0 {
            return Err(ReportError::EmptyPath { slot });
        }
        let s = self.awaiting(slot, Awaiting::Tree)?;
        s.awaiting = None;
        // A path is at most a tree's budget plus its root, and positions stay below the context.
        s.pos += path_len as u32;
        s.next = Some(next);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One scripted call on a scheduler of `&'static str` data.
    enum Op {
        /// Admit a prompt of this many tokens (plain decoding).
        Admit(usize),
        /// Admit a prompt of this many tokens that speculates.
        AdmitSpec(usize),
        Plan,
        Sampled(usize, u32),
        Accepted(usize, usize, u32),
        Remove(usize),
        /// Each occupied slot's state.
        State,
    }
    use Op::*;

    fn work(w: &Work) -> String {
        match w {
            Work::Prefill {
                slot,
                seq,
                range,
                pos0,
                logits_for_last,
            } => format!(
                "s{slot} q{seq} prefill {range:?} @{pos0}{}",
                if *logits_for_last { " logits" } else { "" }
            ),
            Work::Decode {
                slot,
                seq,
                token,
                pos,
            } => format!("s{slot} q{seq} decode t{token} @{pos}"),
            Work::Speculate {
                slot,
                seq,
                root,
                pos,
            } => format!("s{slot} q{seq} tree root t{root} @{pos}"),
        }
    }

    /// Run `ops` on a scheduler of `max_batch` slots and budget `prefill_chunk`; each op
    /// writes one line of the log compared with `expect` (leading and trailing blank space of
    /// each line ignored).
    fn check(max_batch: usize, prefill_chunk: usize, ops: &[Op], expect: &str) {
        let mut s: Scheduler<usize> = Scheduler::new(max_batch, prefill_chunk);
        let mut log = Vec::new();
        for (n, op) in ops.iter().enumerate() {
            let line = match op {
                Admit(len) | AdmitSpec(len) => {
                    let spec = matches!(op, AdmitSpec(_));
                    match s.admit(*len, spec, n) {
                        Ok(slot) => format!("admit {len} -> s{slot}"),
                        Err((e, data)) => {
                            assert_eq!(data, n, "a refused admission returns its data");
                            format!("admit {len} -> refused: {e}")
                        }
                    }
                }
                Plan => {
                    let plan = s.plan();
                    let slots: Vec<usize> = plan.iter().map(Work::slot).collect();
                    let mut sorted = slots.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    assert_eq!(slots, sorted, "one item per slot, in slot order");
                    if plan.is_empty() {
                        "plan: nothing".to_string()
                    } else {
                        let items: Vec<String> = plan.iter().map(work).collect();
                        format!("plan: {}", items.join("; "))
                    }
                }
                Sampled(slot, t) => match s.sampled(*slot, *t) {
                    Ok(()) => format!("sampled s{slot} t{t}"),
                    Err(e) => format!("sampled s{slot} t{t} -> error: {e}"),
                },
                Accepted(slot, len, t) => match s.accepted(*slot, *len, *t) {
                    Ok(()) => format!("accepted s{slot} {len} next t{t}"),
                    Err(e) => format!("accepted s{slot} {len} -> error: {e}"),
                },
                Remove(slot) => match s.remove(*slot) {
                    Some((seq, _)) => format!("remove s{slot} -> q{seq}"),
                    None => format!("remove s{slot} -> nothing"),
                },
                State => {
                    let states: Vec<String> = (0..max_batch)
                        .filter_map(|i| s.state(i))
                        .map(|st| {
                            format!(
                                "q{} fed {}/{} pos {} next {} {}{}",
                                st.seq,
                                st.fed,
                                st.prompt_len,
                                st.pos,
                                st.next.map_or("-".to_string(), |t| format!("t{t}")),
                                match st.awaiting {
                                    None => "idle",
                                    Some(Awaiting::Sample) => "awaits sample",
                                    Some(Awaiting::Tree) => "awaits tree",
                                },
                                if st.speculates { " spec" } else { "" }
                            )
                        })
                        .collect();
                    format!("state: {}", states.join("; "))
                }
            };
            log.push(line);
        }
        let want: Vec<&str> = expect
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(log.join("\n"), want.join("\n"));
    }

    #[test]
    fn budget_splits_a_long_prompt_over_steps() {
        check(
            1,
            4,
            &[Admit(10), Plan, Plan, Plan, State, Plan],
            "
            admit 10 -> s0
            plan: s0 q0 prefill 0..4 @0
            plan: s0 q0 prefill 4..8 @4
            plan: s0 q0 prefill 8..10 @8 logits
            state: q0 fed 10/10 pos 10 next - awaits sample
            plan: nothing
            ",
        );
    }

    #[test]
    fn prompt_of_exactly_the_budget_takes_one_step() {
        check(
            1,
            4,
            &[Admit(4), Plan, Sampled(0, 7), Plan],
            "
            admit 4 -> s0
            plan: s0 q0 prefill 0..4 @0 logits
            sampled s0 t7
            plan: s0 q0 decode t7 @4
            ",
        );
    }

    #[test]
    fn second_prompt_gets_the_rest_of_the_budget() {
        check(
            2,
            8,
            &[Admit(5), Admit(6), Plan, Sampled(0, 1), Plan, State],
            "
            admit 5 -> s0
            admit 6 -> s1
            plan: s0 q0 prefill 0..5 @0 logits; s1 q1 prefill 0..3 @0
            sampled s0 t1
            plan: s0 q0 decode t1 @5; s1 q1 prefill 3..6 @3 logits
            state: q0 fed 5/5 pos 6 next - awaits sample; q1 fed 6/6 pos 6 next - awaits sample
            ",
        );
    }

    #[test]
    fn second_prompt_waits_when_the_first_takes_the_budget() {
        check(
            3,
            4,
            &[Admit(4), Admit(3), Admit(2), Plan, State, Plan, Plan],
            "
            admit 4 -> s0
            admit 3 -> s1
            admit 2 -> s2
            plan: s0 q0 prefill 0..4 @0 logits
            state: q0 fed 4/4 pos 4 next - awaits sample; q1 fed 0/3 pos 0 next - idle; q2 fed 0/2 pos 0 next - idle
            plan: s1 q1 prefill 0..3 @0 logits; s2 q2 prefill 0..1 @0
            plan: s2 q2 prefill 1..2 @1 logits
            ",
        );
    }

    #[test]
    fn decode_is_scheduled_while_another_slot_prefills() {
        // The decode token takes none of the budget: the prompt after it still gets all 3.
        check(
            2,
            3,
            &[
                Admit(2),
                Plan,
                Sampled(0, 9),
                Admit(7),
                Plan,
                Sampled(0, 8),
                Plan,
            ],
            "
            admit 2 -> s0
            plan: s0 q0 prefill 0..2 @0 logits
            sampled s0 t9
            admit 7 -> s1
            plan: s0 q0 decode t9 @2; s1 q1 prefill 0..3 @0
            sampled s0 t8
            plan: s0 q0 decode t8 @3; s1 q1 prefill 3..6 @3
            ",
        );
    }

    #[test]
    fn budget_one_feeds_one_prompt_token_per_step() {
        check(
            2,
            1,
            &[Admit(2), Admit(1), Plan, Plan, Sampled(0, 5), Plan],
            "
            admit 2 -> s0
            admit 1 -> s1
            plan: s0 q0 prefill 0..1 @0
            plan: s0 q0 prefill 1..2 @1 logits
            sampled s0 t5
            plan: s0 q0 decode t5 @2; s1 q1 prefill 0..1 @0 logits
            ",
        );
    }

    #[test]
    fn budget_zero_counts_as_one() {
        check(
            1,
            0,
            &[Admit(2), Plan, Plan],
            "
            admit 2 -> s0
            plan: s0 q0 prefill 0..1 @0
            plan: s0 q0 prefill 1..2 @1 logits
            ",
        );
    }

    #[test]
    fn empty_prompt_is_refused() {
        check(
            1,
            4,
            &[Admit(0), Plan, Admit(1)],
            "
            admit 0 -> refused: expected a prompt of at least one token, found none
            plan: nothing
            admit 1 -> s0
            ",
        );
    }

    #[test]
    fn admission_up_to_max_batch_then_refusal() {
        check(
            2,
            4,
            &[Admit(1), Admit(1), Admit(1), State],
            "
            admit 1 -> s0
            admit 1 -> s1
            admit 1 -> refused: no free slot in the running batch: all 2 slots hold a sequence
            state: q0 fed 0/1 pos 0 next - idle; q1 fed 0/1 pos 0 next - idle
            ",
        );
    }

    #[test]
    fn removed_slot_is_reused_from_position_zero() {
        check(
            2,
            8,
            &[
                Admit(3),
                Admit(2),
                Plan,
                Sampled(0, 4),
                Sampled(1, 5),
                Plan,
                Remove(0),
                Remove(0),
                Admit(6),
                State,
                Plan,
            ],
            "
            admit 3 -> s0
            admit 2 -> s1
            plan: s0 q0 prefill 0..3 @0 logits; s1 q1 prefill 0..2 @0 logits
            sampled s0 t4
            sampled s1 t5
            plan: s0 q0 decode t4 @3; s1 q1 decode t5 @2
            remove s0 -> q0
            remove s0 -> nothing
            admit 6 -> s0
            state: q0 fed 0/6 pos 0 next - idle; q1 fed 2/2 pos 3 next - awaits sample
            plan: s0 q0 prefill 0..6 @0 logits
            ",
        );
    }

    #[test]
    fn finished_sequence_leaves_no_work() {
        // Slot 0 finished on its sampled token: removed, it gets nothing, slot 1 goes on.
        check(
            2,
            8,
            &[
                Admit(1),
                Admit(1),
                Plan,
                Sampled(1, 3),
                Remove(0),
                Plan,
                Plan,
            ],
            "
            admit 1 -> s0
            admit 1 -> s1
            plan: s0 q0 prefill 0..1 @0 logits; s1 q1 prefill 0..1 @0 logits
            sampled s1 t3
            remove s0 -> q0
            plan: s1 q1 decode t3 @1
            plan: nothing
            ",
        );
    }

    #[test]
    fn speculation_roots_the_tree_at_the_pending_token() {
        // The prompt's first token is sampled plainly; then the pending token is each tree's
        // root at the next position, which advances by the accepted path's length.
        check(
            1,
            8,
            &[
                AdmitSpec(3),
                Plan,
                Sampled(0, 11),
                Plan,
                State,
                Accepted(0, 3, 12),
                State,
                Plan,
                Accepted(0, 1, 13),
                Plan,
            ],
            "
            admit 3 -> s0
            plan: s0 q0 prefill 0..3 @0 logits
            sampled s0 t11
            plan: s0 q0 tree root t11 @3
            state: q0 fed 3/3 pos 3 next - awaits tree spec
            accepted s0 3 next t12
            state: q0 fed 3/3 pos 6 next t12 idle spec
            plan: s0 q0 tree root t12 @6
            accepted s0 1 next t13
            plan: s0 q0 tree root t13 @7
            ",
        );
    }

    #[test]
    fn positions_after_prefill_chunk_decode_and_tree() {
        // Plain and speculating sequences side by side: a prompt chunk advances by its length,
        // a decode by one, a tree by its accepted path only once reported.
        check(
            2,
            2,
            &[
                Admit(3),
                AdmitSpec(1),
                Plan,
                State,
                Plan,
                Sampled(0, 20),
                Sampled(1, 30),
                State,
                Plan,
                State,
                Sampled(0, 21),
                Accepted(1, 4, 31),
                State,
            ],
            "
            admit 3 -> s0
            admit 1 -> s1
            plan: s0 q0 prefill 0..2 @0
            state: q0 fed 2/3 pos 2 next - idle; q1 fed 0/1 pos 0 next - idle spec
            plan: s0 q0 prefill 2..3 @2 logits; s1 q1 prefill 0..1 @0 logits
            sampled s0 t20
            sampled s1 t30
            state: q0 fed 3/3 pos 3 next t20 idle; q1 fed 1/1 pos 1 next t30 idle spec
            plan: s0 q0 decode t20 @3; s1 q1 tree root t30 @1
            state: q0 fed 3/3 pos 4 next - awaits sample; q1 fed 1/1 pos 1 next - awaits tree spec
            sampled s0 t21
            accepted s1 4 next t31
            state: q0 fed 3/3 pos 4 next t21 idle; q1 fed 1/1 pos 5 next t31 idle spec
            ",
        );
    }

    #[test]
    fn cancelled_mid_prefill_frees_the_budget_for_the_next() {
        check(
            2,
            4,
            &[Admit(10), Admit(3), Plan, Remove(0), Plan, Admit(2), State],
            "
            admit 10 -> s0
            admit 3 -> s1
            plan: s0 q0 prefill 0..4 @0
            remove s0 -> q0
            plan: s1 q1 prefill 0..3 @0 logits
            admit 2 -> s0
            state: q0 fed 0/2 pos 0 next - idle; q1 fed 3/3 pos 3 next - awaits sample
            ",
        );
    }

    #[test]
    fn work_follows_slot_order_not_admission_order() {
        // Slot 1 was admitted first; after slot 0 is freed and refilled, slot 0 comes first.
        check(
            3,
            16,
            &[
                Admit(1),
                Admit(2),
                Remove(0),
                Admit(3),
                Admit(1),
                Plan,
            ],
            "
            admit 1 -> s0
            admit 2 -> s1
            remove s0 -> q0
            admit 3 -> s0
            admit 1 -> s2
            plan: s0 q0 prefill 0..3 @0 logits; s1 q1 prefill 0..2 @0 logits; s2 q2 prefill 0..1 @0 logits
            ",
        );
    }

    #[test]
    fn budget_is_shared_in_slot_order_each_step() {
        // Slot 0 takes what it needs first every step; slot 1 gets the rest, then slot 2.
        check(
            3,
            5,
            &[Admit(7), Admit(4), Admit(4), Plan, Plan, Plan],
            "
            admit 7 -> s0
            admit 4 -> s1
            admit 4 -> s2
            plan: s0 q0 prefill 0..5 @0
            plan: s0 q0 prefill 5..7 @5 logits; s1 q1 prefill 0..3 @0
            plan: s1 q1 prefill 3..4 @3 logits; s2 q2 prefill 0..4 @0 logits
            ",
        );
    }

    #[test]
    fn decode_and_trees_are_scheduled_after_the_budget_is_spent() {
        // Slot 0's new prompt spends the whole budget; slots 1 and 2 are fed all the same.
        check(
            3,
            2,
            &[
                Admit(1),
                Admit(1),
                AdmitSpec(1),
                Plan,
                Sampled(0, 6),
                Sampled(1, 7),
                Plan,
                Sampled(1, 9),
                Sampled(2, 8),
                Remove(0),
                Admit(5),
                Plan,
            ],
            "
            admit 1 -> s0
            admit 1 -> s1
            admit 1 -> s2
            plan: s0 q0 prefill 0..1 @0 logits; s1 q1 prefill 0..1 @0 logits
            sampled s0 t6
            sampled s1 t7
            plan: s0 q0 decode t6 @1; s1 q1 decode t7 @1; s2 q2 prefill 0..1 @0 logits
            sampled s1 t9
            sampled s2 t8
            remove s0 -> q0
            admit 5 -> s0
            plan: s0 q0 prefill 0..2 @0; s1 q1 decode t9 @2; s2 q2 tree root t8 @1
            ",
        );
    }

    #[test]
    fn reports_that_do_not_match_the_plan_are_errors() {
        check(
            3,
            4,
            &[
                Admit(6),
                AdmitSpec(1),
                Plan,
                Sampled(0, 1),
                Accepted(1, 2, 5),
                Plan,
                Accepted(1, 2, 5),
                Sampled(1, 3),
                Plan,
                Sampled(1, 4),
                Accepted(1, 0, 5),
                Sampled(2, 1),
                Accepted(9, 1, 1),
                State,
            ],
            "
            admit 6 -> s0
            admit 1 -> s1
            plan: s0 q0 prefill 0..4 @0
            sampled s0 t1 -> error: expected a report of nothing for slot 0, found a sampled token
            accepted s1 2 -> error: expected a report of nothing for slot 1, found a tree's accepted path
            plan: s0 q0 prefill 4..6 @4 logits; s1 q1 prefill 0..1 @0 logits
            accepted s1 2 -> error: expected a report of a sampled token for slot 1, found a tree's accepted path
            sampled s1 t3
            plan: s1 q1 tree root t3 @1
            sampled s1 t4 -> error: expected a report of a tree's accepted path for slot 1, found a sampled token
            accepted s1 0 -> error: expected an accepted path of at least the root for slot 1, found none
            sampled s2 t1 -> error: expected a sequence in slot 2, found a free slot
            accepted s9 1 -> error: expected a sequence in slot 9, found no such slot (the batch has 3)
            state: q0 fed 6/6 pos 6 next - awaits sample; q1 fed 1/1 pos 1 next - awaits tree spec
            ",
        );
    }

    /// Every prompt-length mix of up to three sequences under budgets 1..=6, run to the end
    /// (each sequence decodes three tokens after its prompt, then finishes): each prompt is fed
    /// exactly once, in order, at positions equal to its token indices; no step feeds more
    /// prompt tokens than the budget, nor leaves budget unused while a prompt waits; logits
    /// come with a prompt's last token only; decode positions follow the prompt one by one.
    #[test]
    fn every_mix_is_fed_once_in_order_within_the_budget() {
        const DECODES: u32 = 3;
        let lens = [1usize, 2, 3, 5, 8];
        let mut mixes: Vec<Vec<usize>> = Vec::new();
        for &a in &lens {
            mixes.push(vec![a]);
            for &b in &lens {
                mixes.push(vec![a, b]);
                for &c in &lens {
                    mixes.push(vec![a, b, c]);
                }
            }
        }
        for budget in 1..=6usize {
            for mix in &mixes {
                let ctx = format!("budget {budget}, prompts {mix:?}");
                let mut s: Scheduler<usize> = Scheduler::new(mix.len(), budget);
                for (i, &len) in mix.iter().enumerate() {
                    assert_eq!(s.admit(len, false, i).ok(), Some(i), "{ctx}");
                }
                // What each sequence was fed so far, tracked apart from the scheduler.
                let mut fed = vec![0usize; mix.len()];
                let mut decoded = vec![0u32; mix.len()];
                let mut steps = 0;
                while s.n_active() > 0 {
                    steps += 1;
                    assert!(steps <= 100, "{ctx}: no end after 100 steps");
                    let plan = s.plan();
                    let mut prompt_tokens = 0;
                    for w in &plan {
                        match w.clone() {
                            Work::Prefill {
                                slot,
                                seq,
                                range,
                                pos0,
                                logits_for_last,
                            } => {
                                assert_eq!(seq as usize, slot, "{ctx}");
                                assert_eq!(range.start, fed[slot], "{ctx}: {w:?}");
                                assert!(range.end > range.start, "{ctx}: {w:?}");
                                assert_eq!(pos0 as usize, range.start, "{ctx}: {w:?}");
                                assert_eq!(logits_for_last, range.end == mix[slot], "{ctx}: {w:?}");
                                prompt_tokens += range.len();
                                fed[slot] = range.end;
                                if logits_for_last {
                                    let sampled = s.sampled(slot, 100 + slot as u32);
                                    assert_eq!(sampled, Ok(()), "{ctx}: {w:?}");
                                }
                            }
                            Work::Decode {
                                slot, token, pos, ..
                            } => {
                                assert_eq!(fed[slot], mix[slot], "{ctx}: {w:?}");
                                assert_eq!(token, 100 + slot as u32 + decoded[slot], "{ctx}");
                                assert_eq!(pos as usize, mix[slot] + decoded[slot] as usize);
                                decoded[slot] += 1;
                                if decoded[slot] == DECODES {
                                    assert!(s.remove(slot).is_some(), "{ctx}: {w:?}");
                                } else {
                                    let next = 100 + slot as u32 + decoded[slot];
                                    assert_eq!(s.sampled(slot, next), Ok(()), "{ctx}: {w:?}");
                                }
                            }
                            Work::Speculate { .. } => panic!("{ctx}: a tree without speculation"),
                        }
                    }
                    assert!(prompt_tokens <= budget, "{ctx}: {plan:?}");
                    let waiting =
                        (0..mix.len()).any(|i| s.state(i).is_some_and(|st| st.fed < st.prompt_len));
                    assert!(
                        !waiting || prompt_tokens == budget,
                        "{ctx}: {prompt_tokens} of {budget} budget used while a prompt waits: {plan:?}"
                    );
                }
                assert_eq!(fed, *mix, "{ctx}");
                assert!(decoded.iter().all(|&d| d == DECODES), "{ctx}: {decoded:?}");
            }
        }
    }
}
