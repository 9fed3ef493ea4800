//! `plumbline serve` end to end: a live server process on loopback, driven over HTTP by the
//! official `openai` Python client, by raw sockets (malformed requests, disconnects) and by
//! `plumbline generate` for comparison. Most tests run on a fixture GGUF (tiny, fast); the
//! `real_model` ones run on Gemma 3 270M when it has been fetched.

mod api;
mod engines;
mod malformed;
mod readiness;
mod real_model;
mod support;
