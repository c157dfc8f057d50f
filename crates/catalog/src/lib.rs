//! The template catalog: templates by name over the engine.
//!
//! Place in the flow request -> runtime -> sessions -> **catalog** -> engine:
//! the recipes (shipped, custom, a session's checkpoint made a template),
//! their builds in the background, every template opened so far by id, the
//! namespaces of owners (an owner's own templates beside the shipped and
//! shared ones; what an owner may add is the caller's rule,
//! [`Catalog::set_owner_rules`]), and in a cluster the templates, images and
//! package layers shared through a bucket ([`shared`]). The engine under it
//! runs sandboxes of one template; it knows nothing of names or owners.

#![forbid(unsafe_code)]

pub mod catalog;
pub mod shared;

pub use catalog::{Catalog, CatalogError, Loaded, OwnerRules, OwnerUsage, DEFAULT_TEMPLATE};
