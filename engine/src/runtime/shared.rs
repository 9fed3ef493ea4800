//! [`Shared`]: a value an engine uses, either borrowed from its caller or owned (behind an
//! `Arc`) by the engine itself. Callers that keep their own backend lend it
//! (`Engine::new(&model, &backend)`); the one place that opens devices (`crate::exec::open`)
//! hands its backends over (`Engine::owning`, `TpEngine::over_shm_owned`), so the engine it returns borrows nothing but the model.

use std::ops::Deref;
use std::sync::Arc;

/// Borrowed or owned; derefs to `T` either way.
pub enum Shared<'a, T: ?Sized> {
    Borrowed(&'a T),
    Owned(Arc<T>),
}

impl<T: ?Sized> Deref for Shared<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Shared::Borrowed(t) => t,
            Shared::Owned(t) => t,
        }
    }
}

impl<'a, T: ?Sized> From<&'a T> for Shared<'a, T> {
    fn from(t: &'a T) -> Self {
        Shared::Borrowed(t)
    }
}

impl<T: ?Sized> Clone for Shared<'_, T> {
    fn clone(&self) -> Self {
        match self {
            Shared::Borrowed(t) => Shared::Borrowed(t),
            Shared::Owned(t) => Shared::Owned(t.clone()),
        }
    }
}
