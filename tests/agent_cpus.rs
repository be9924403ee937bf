//! `AgentBuilder::cpus`: where the threads kvlane starts run when the
//! thread that builds the agent was narrowed to one core (vLLM's CPU
//! worker pins its main thread before it builds the transport).
//!
//! One test per process (this file): the pools are process-wide, and a
//! second agent would reuse the threads the first one placed.

use kvlane::data::{Access, Region};
use kvlane::{Agent, BackendChoice, CpuPlacement, ErrorKind};

/// A kernel cpu list (`0-1,3`) as CPU numbers.
fn parse_list(s: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<u32>().unwrap()..=b.parse().unwrap()),
            None => out.push(part.parse().unwrap()),
        }
    }
    out
}

/// `Cpus_allowed_list` of each thread of this process whose name starts
/// with `prefix`.
fn masks_of(prefix: &str) -> Vec<(String, Vec<u32>)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let comm = comm.trim().to_owned();
        if !comm.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap();
        out.push((comm, parse_list(list)));
    }
    out
}

fn mask_of_this_thread() -> Vec<u32> {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    parse_list(
        status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap(),
    )
}

#[test]
fn all_widens_kvlane_threads_past_a_narrowed_builder_and_bad_lists_are_named() {
    let process = mask_of_this_thread();
    let first = process[0];
    std::thread::spawn(move || {
        // Narrowed as vLLM's worker is, before anything of kvlane starts.
        CpuPlacement::Cpus(vec![first])
            .apply_to_current_thread()
            .unwrap();
        assert_eq!(mask_of_this_thread(), vec![first]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // A list is checked when the agent is built, and named.
            let e = Agent::builder()
                .backend(BackendChoice::Tcp)
                .cpus(CpuPlacement::Cpus(vec![kvlane::data::MAX_CPU]))
                .build()
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
            assert!(e.to_string().contains("1023"), "{e}");
            let e = "0-x".parse::<CpuPlacement>().unwrap_err();
            assert!(e.to_string().contains("\"0-x\""), "{e}");

            let region = Region::from_vec(vec![0u8; 4096], Access::ALL).unwrap();
            let a = Agent::builder()
                .backend(BackendChoice::Tcp)
                .cpus(CpuPlacement::All)
                .register_region(region)
                .build()
                .await
                .unwrap();
            // A new thread names itself, then applies the placement: look
            // until each has (a thread left narrowed never gets there).
            let kinds = ["kvlane-progress", "kvlane-tcp-io", "kvlane-tcp-init"];
            let placed = |threads: &[(String, Vec<u32>)]| {
                kinds
                    .iter()
                    .all(|k| threads.iter().any(|(n, _)| n.starts_with(k)))
                    && threads.iter().all(|(_, m)| *m == process)
            };
            let mut threads = masks_of("kvlane-");
            for _ in 0..500 {
                if placed(&threads) {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                threads = masks_of("kvlane-");
            }
            assert!(
                placed(&threads),
                "kvlane threads not all on every cpu of the process {process:?}: {threads:?}"
            );
            a.close().await;
        });
    })
    .join()
    .unwrap();
}
