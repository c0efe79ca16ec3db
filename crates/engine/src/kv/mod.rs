//! KV caches. Preallocated to a maximum length and updated in place (never concatenated),
//! so decode steps have fixed shapes.

pub mod dense;
