//! Where the threads kvlane starts may run: [`CpuPlacement`].
//!
//! An engine decides thread placement. vLLM's CPU worker pins its main
//! thread to one core before it builds the transport, so by default
//! ([`CpuPlacement::Inherit`]) every thread kvlane starts takes the mask of
//! the thread that starts it, as any thread does on Linux: the engine's
//! placement is kvlane's. [`CpuPlacement::All`] widens kvlane's threads to
//! every CPU the process may use, and [`CpuPlacement::Cpus`] sets a list.
//! The setting comes from the agent's builder, else from the environment
//! variable [`ENV_CPUS`] (`KVLANE_CPUS=inherit|all|0-3,8`).
//!
//! # Which threads, and when
//!
//! Every thread kvlane starts applies the placement as it begins: progress
//! threads, tcp I/O and server threads, rails threads, verbs progress
//! threads, and the tokio workers of the runtimes kvlane builds (the CLI's,
//! the Python binding's). A thread started by a thread kvlane placed
//! carries the placement on. Threads are shared by the agents of a process
//! (one progress pool, one tcp I/O pool per thread count, one runtime in
//! the Python binding): a shared thread keeps the placement of the agent
//! whose build started it. An agent that wants other CPUs than the ones
//! the running pools were started with needs a process of its own.
//!
//! # How `all` is found
//!
//! The caller may already be narrowed (the point of `all`), so the
//! caller's mask says nothing. `all` asks for the CPUs that are online and
//! not isolated (`/sys/devices/system/cpu/online` minus `.../isolated`;
//! every CPU the mask can name when those cannot be read), and the kernel
//! intersects that with the process's cpuset (its cgroup):
//! `sched_setaffinity` never widens a thread past its cpuset, so `all` is
//! "what the cpuset lets the process use". A `taskset` of the whole
//! process is a mask, not a cpuset: `all` widens past it, by design.

use crate::error::DataError;
use std::cell::RefCell;
use std::fmt;
use std::str::FromStr;
use std::thread::{self, JoinHandle};

/// The environment variable that places kvlane's threads when the builder
/// does not: `inherit` (the default), `all`, or a CPU list like `0-3,8`.
pub const ENV_CPUS: &str = "KVLANE_CPUS";

/// Largest CPU number a list may name (the kernel's `cpu_set_t` holds
/// CPUs `0..1024`).
pub const MAX_CPU: u32 = 1023;

/// Where the threads kvlane starts run (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CpuPlacement {
    /// Each thread takes the mask of the thread that starts it: the
    /// engine's placement (the default).
    #[default]
    Inherit,
    /// Every CPU the process may use (its cpuset), whatever the mask of
    /// the thread that builds the agent.
    All,
    /// These CPUs (sorted, without duplicates, never empty).
    Cpus(Vec<u32>),
}

impl CpuPlacement {
    /// The placement [`ENV_CPUS`] asks for: `None` when it is unset or
    /// empty, an error naming the value when it does not parse.
    pub fn from_env() -> Result<Option<Self>, DataError> {
        match std::env::var(ENV_CPUS) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => v.parse().map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(DataError::InvalidCpus {
                value: v.to_string_lossy().into_owned(),
                reason: "not valid UTF-8",
            }),
        }
    }

    /// `explicit` if given, else what [`ENV_CPUS`] says, else
    /// [`Inherit`](Self::Inherit).
    pub fn resolve(explicit: Option<&Self>) -> Result<Self, DataError> {
        match explicit {
            Some(p) => Ok(p.clone()),
            None => Ok(Self::from_env()?.unwrap_or_default()),
        }
    }

    /// Applies the placement to the calling thread (nothing for
    /// [`Inherit`](Self::Inherit)). Fails when none of the CPUs is one
    /// the process may use.
    pub fn apply_to_current_thread(&self) -> Result<(), DataError> {
        let cpus = match self {
            Self::Inherit => return Ok(()),
            Self::All => usable_cpus(),
            Self::Cpus(c) => c.clone(),
        };
        set_affinity(&cpus).map_err(|source| DataError::Placement {
            cpus: self.to_string(),
            source,
        })
    }

    /// Checks, on a short-lived thread, that the placement can be applied
    /// (an agent's builder calls it, so a bad list fails the build instead
    /// of every thread logging it).
    pub fn check(&self) -> Result<(), DataError> {
        if *self == Self::Inherit {
            return Ok(());
        }
        let p = self.clone();
        thread::Builder::new()
            .name("kvlane-cpus-check".into())
            .spawn(move || p.apply_to_current_thread())
            .map_err(|source| DataError::Io {
                op: "spawn a thread to check the cpu placement".into(),
                source,
            })?
            .join()
            .unwrap_or_else(|_| {
                Err(DataError::InvalidCpus {
                    value: self.to_string(),
                    reason: "could not be checked (the check panicked)",
                })
            })
    }

    /// Runs `f` with this placement as the one that threads kvlane starts
    /// from this thread apply; the previous one is restored after. `f`
    /// runs on this thread: the scope does not follow an `.await`.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        let old = AMBIENT.with(|a| a.replace(Some(self.clone())));
        let _restore = Restore(old);
        f()
    }

    /// The placement threads started from this thread apply: the one of
    /// the enclosing [`scope`](Self::scope), or the one this thread
    /// (started by kvlane) applied, else [`ENV_CPUS`] (an invalid value
    /// counts as [`Inherit`](Self::Inherit); building an agent reports it).
    pub fn ambient() -> Self {
        AMBIENT
            .with(|a| a.borrow().clone())
            .unwrap_or_else(|| Self::from_env().ok().flatten().unwrap_or_default())
    }
}

impl CpuPlacement {
    /// Applies the placement to the calling thread, a thread kvlane
    /// started (a runtime's worker calls it from `on_thread_start`), and
    /// makes it the one the threads it starts apply. A failure is logged
    /// and the thread keeps the cpus it inherited.
    pub fn enter(self) {
        if let Err(e) = self.apply_to_current_thread() {
            tracing::warn!(error = %e, "kvlane thread keeps the cpus it inherited");
        }
        AMBIENT.with(|a| *a.borrow_mut() = Some(self));
    }
}

struct Restore(Option<CpuPlacement>);

impl Drop for Restore {
    fn drop(&mut self) {
        let old = self.0.take();
        AMBIENT.with(|a| *a.borrow_mut() = old);
    }
}

thread_local! {
    /// The placement of this thread's [`CpuPlacement::scope`], or the one
    /// this thread was started with by [`spawn`].
    static AMBIENT: RefCell<Option<CpuPlacement>> = const { RefCell::new(None) };
}

/// Starts a thread that first applies the [ambient](CpuPlacement::ambient)
/// placement of the calling thread (and carries it on to the threads it
/// starts). A placement that cannot be applied is logged and the thread
/// runs where it inherited.
pub(crate) fn spawn<F, T>(builder: thread::Builder, f: F) -> std::io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let placement = CpuPlacement::ambient();
    builder.spawn(move || {
        placement.enter();
        f()
    })
}

impl fmt::Display for CpuPlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Inherit => f.write_str("inherit"),
            Self::All => f.write_str("all"),
            Self::Cpus(c) => f.write_str(&format_list(c)),
        }
    }
}

impl FromStr for CpuPlacement {
    type Err = DataError;

    /// `inherit`, `all`, or a list of CPUs and ranges: `0-3,8`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        match t.to_ascii_lowercase().as_str() {
            "inherit" => return Ok(Self::Inherit),
            "all" => return Ok(Self::All),
            _ => {}
        }
        let bad = |reason| DataError::InvalidCpus {
            value: s.to_owned(),
            reason,
        };
        let cpus = parse_list(t).map_err(bad)?;
        if cpus.is_empty() {
            return Err(bad("names no cpu"));
        }
        Ok(Self::Cpus(cpus))
    }
}

/// A kernel cpu list (`0-3,8`) as sorted, deduplicated CPU numbers.
fn parse_list(s: &str) -> Result<Vec<u32>, &'static str> {
    let num = |x: &str| -> Result<u32, &'static str> {
        let n: u32 = x
            .trim()
            .parse()
            .map_err(|_| "is not inherit, all, or a cpu number or range")?;
        if n > MAX_CPU {
            return Err("names a cpu past 1023");
        }
        Ok(n)
    };
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err("has a range whose start is past its end");
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// CPU numbers as a kernel cpu list (`0-3,8`).
fn format_list(cpus: &[u32]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

/// Online CPUs that are not isolated; every CPU a mask can name when
/// sysfs cannot tell (the kernel clamps the mask to the cpuset anyway).
fn usable_cpus() -> Vec<u32> {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| parse_list(s.trim()).ok())
    };
    let Some(online) = read("/sys/devices/system/cpu/online").filter(|c| !c.is_empty()) else {
        return (0..=MAX_CPU).collect();
    };
    let isolated = read("/sys/devices/system/cpu/isolated").unwrap_or_default();
    let usable: Vec<u32> = online
        .iter()
        .copied()
        .filter(|c| !isolated.contains(c))
        .collect();
    if usable.is_empty() {
        online
    } else {
        usable
    }
}

#[cfg(target_os = "linux")]
fn set_affinity(cpus: &[u32]) -> std::io::Result<()> {
    // SAFETY: `cpu_set_t` is plain data for which all-zero bytes are a
    // valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // `parse_list` and `usable_cpus` keep CPUs <= MAX_CPU (1023),
        // inside the set's CPU_SETSIZE (1024) bits; checked again here.
        if (c as usize) < libc::CPU_SETSIZE as usize {
            // SAFETY: CPU_SET writes the bit of `c` inside `set`, which
            // holds CPU_SETSIZE bits, and `c` is below that.
            unsafe { libc::CPU_SET(c as usize, &mut set) };
        }
    }
    // SAFETY: pid 0 is the calling thread; the kernel reads
    // `size_of::<cpu_set_t>()` bytes from `set`, which lives on this
    // stack for the whole call.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_affinity(_: &[u32]) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "cpu placement is only implemented on Linux",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms() {
        assert_eq!(
            "inherit".parse::<CpuPlacement>().unwrap(),
            CpuPlacement::Inherit
        );
        assert_eq!(" ALL ".parse::<CpuPlacement>().unwrap(), CpuPlacement::All);
        assert_eq!(
            "8,0-3,2".parse::<CpuPlacement>().unwrap(),
            CpuPlacement::Cpus(vec![0, 1, 2, 3, 8])
        );
        assert_eq!(
            CpuPlacement::Cpus(vec![0, 1, 2, 3, 8, 10, 11]).to_string(),
            "0-3,8,10-11"
        );
    }

    #[test]
    fn bad_values_are_named() {
        for bad in ["some", "3-1", "1,x", ",", "4096", "0-99999", "-1"] {
            let e = bad.parse::<CpuPlacement>().unwrap_err();
            assert!(
                matches!(&e, DataError::InvalidCpus { value, .. } if value == bad),
                "{bad:?}: {e:?}"
            );
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[cfg(target_os = "linux")]
    fn mask_of_this_thread() -> Vec<u32> {
        let s = std::fs::read_to_string(format!(
            "/proc/self/task/{}/status",
            // SAFETY: gettid has no preconditions.
            unsafe { libc::gettid() }
        ))
        .unwrap();
        let line = s
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap();
        parse_list(line.trim()).unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_spawned_thread_applies_the_scope_and_carries_it_on() {
        let all = thread::spawn(|| {
            CpuPlacement::All.apply_to_current_thread().unwrap();
            mask_of_this_thread()
        })
        .join()
        .unwrap();
        let first = all[0];
        // A thread narrowed to one cpu starts kvlane threads placed on all
        // of them, and those start threads placed the same way.
        let (child, grandchild) = thread::spawn(move || {
            CpuPlacement::Cpus(vec![first])
                .apply_to_current_thread()
                .unwrap();
            CpuPlacement::All.scope(|| {
                spawn(thread::Builder::new(), || {
                    let g = spawn(thread::Builder::new(), mask_of_this_thread)
                        .unwrap()
                        .join()
                        .unwrap();
                    (mask_of_this_thread(), g)
                })
                .unwrap()
                .join()
                .unwrap()
            })
        })
        .join()
        .unwrap();
        assert_eq!(child, all);
        assert_eq!(grandchild, all);
        // Inherit: the narrowed mask.
        let inherited = thread::spawn(move || {
            CpuPlacement::Cpus(vec![first])
                .apply_to_current_thread()
                .unwrap();
            CpuPlacement::Inherit.scope(|| {
                spawn(thread::Builder::new(), mask_of_this_thread)
                    .unwrap()
                    .join()
                    .unwrap()
            })
        })
        .join()
        .unwrap();
        assert_eq!(inherited, vec![first]);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_list_outside_the_cpuset_fails_the_check() {
        let e = CpuPlacement::Cpus(vec![MAX_CPU]).check().unwrap_err();
        assert!(matches!(e, DataError::Placement { .. }), "{e:?}");
    }
}
