//! The guest program of the syscall fuzzer, shared by the
//! engine's in-process fuzz test and the worker-level one on the real server:
//! a Python program that issues `calls` random system calls through ctypes'
//! `syscall()` — every number in forkbox's syscall table and beyond, with wild
//! pointers, garbage buffers, huge lengths, bad fds and random flags. A seed
//! makes a run reproducible; `verbose` logs each call on stderr (`@call ...`)
//! so a failing chunk can be replayed to find the call.

/// The program's body; `SEED`, `CALLS`, `TABLE`, `VERBOSE` are prepended by [`program`].
const FUZZER: &str = include_str!("syscall_fuzz.py");

/// The fuzzer for one seed. It prints `fuzz-done N` if it survives its calls.
pub fn program(seed: u64, calls: u64, verbose: bool) -> String {
    let table: Vec<String> = forkbox_linux::syscalls::TABLE.iter().map(|e| e.nr.to_string()).collect();
    format!(
        "SEED = {seed}\nCALLS = {calls}\nVERBOSE = {}\nTABLE = [{}]\n{FUZZER}",
        if verbose { "True" } else { "False" },
        table.join(", ")
    )
}

/// A run's size from the environment (`FORKBOX_FUZZ_SEEDS`, `FORKBOX_FUZZ_CHUNKS`,
/// `FORKBOX_FUZZ_CALLS`, `FORKBOX_FUZZ_FIRST_SEED`), else `default`.
pub fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
