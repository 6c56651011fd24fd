#![allow(dead_code)]
pub mod proxy;
