//! paratune: find the fastest way to train a large transformer on a GPU cluster.
//!
//! The library is split the way the data flows (see ARCHITECTURE.md):
//! specs ([`model`], [`cluster`]) and a parallel [`config`] go into the pure
//! cost model ([`cost`]), whose coefficients live in [`coefficients`]; the
//! [`search`] enumerates and ranks configurations; [`export`] turns a winner
//! into launch arguments; [`runs`] reads measured runs and [`evaluate`] scores
//! the cost model against them; [`profile`] holds measured collectives and
//! layers that the cost model uses where they cover the case. Only
//! `src/main.rs` knows about the terminal.

pub mod atomic;
pub mod calibrate;
pub mod choice;
pub mod cluster;
pub mod coefficients;
pub mod config;
pub mod cost;
pub mod date;
pub mod evaluate;
pub mod export;
pub mod measure;
pub mod model;
pub mod plan_file;
pub mod profile;
pub mod report;
pub mod runs;
pub mod search;
pub mod suggest;
pub mod text;
pub mod toml_error;
pub mod units;
pub mod validate;
