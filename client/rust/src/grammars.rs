//! The reference planner's grammars (contract §3 step 4, §7), as
//! client/grammars.py: a handle is borrowed by one lane at a time, so each
//! constrained request's grammar is registered for that request alone, when
//! it is submitted (a bad grammar fails the submit with the worker's
//! message), and released once the request is done. A handle dies with its
//! worker: after a restart the book forgets them and the next admission
//! registers again. A re-admitted request replays its generated tokens into
//! the fresh matcher (`grammar_replay` = generated), so it goes on exactly
//! where it was.
use crate::connection::Connection;
use crate::events::Error;
use std::collections::HashMap;
use std::time::Duration;

/// What a request's output must follow: `kind` json_schema, regex, lark or
/// gbnf with its text, or exactly one of a list of strings (kind "choice").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grammar {
    Text { kind: String, text: String },
    Choice(Vec<String>),
}

impl Grammar {
    /// A grammar of `kind` (json_schema, regex, lark, gbnf) and its text.
    pub fn text(kind: &str, text: &str) -> Grammar {
        Grammar::Text { kind: kind.into(), text: text.into() }
    }
    pub fn json_schema(schema: &str) -> Grammar {
        Grammar::text("json_schema", schema)
    }
    pub fn regex(pattern: &str) -> Grammar {
        Grammar::text("regex", pattern)
    }
    /// Exactly one of `choices`.
    pub fn choice<S: AsRef<str>>(choices: &[S]) -> Grammar {
        Grammar::Choice(choices.iter().map(|c| c.as_ref().into()).collect())
    }
    pub fn kind(&self) -> &str {
        match self {
            Grammar::Text { kind, .. } => kind,
            Grammar::Choice(_) => "choice",
        }
    }
    /// A malformed spec (as client/grammars.py's `fields`): a choice grammar is a list.
    pub(crate) fn check(&self) -> Result<(), Error> {
        match self {
            Grammar::Text { kind, .. } if kind == "choice" => {
                Err(Error::Bounds("a choice grammar is a list of strings".into()))
            }
            _ => Ok(()),
        }
    }
}

/// Each constrained request's handle on the current worker.
#[derive(Debug, Default)]
pub struct GrammarBook {
    handles: HashMap<usize, u64>, // request index -> handle
    /// REGISTER_GRAMMAR answered OK.
    pub registered: u64,
}

impl GrammarBook {
    /// Request `req`'s handle, registering `g` if this worker has none for it.
    pub fn handle(&mut self, c: &mut Connection, req: usize, g: &Grammar, timeout: Duration)
                  -> Result<u64, Error> {
        if let Some(&h) = self.handles.get(&req) {
            return Ok(h);
        }
        let h = c.register_grammar(g, timeout)?;
        self.handles.insert(req, h);
        self.registered += 1;
        Ok(h)
    }

    /// Request `req` is done: its grammar can go. A handle the worker no
    /// longer knows, or a worker gone with it, is gone anyway.
    pub fn release(&mut self, c: &mut Connection, req: usize, timeout: Duration) -> Result<(), Error> {
        let Some(h) = self.handles.remove(&req) else { return Ok(()) };
        match c.release_grammar(h, timeout) {
            Ok(()) | Err(Error::Op { .. }) | Err(Error::WorkerGone) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The worker restarted: its grammars are gone.
    pub fn forget(&mut self) {
        self.handles.clear();
    }

    /// Handles held now.
    pub fn held(&self) -> usize {
        self.handles.len()
    }
}
