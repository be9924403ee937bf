//! Topology read from fixture sysfs trees (tests/data/topology, written by
//! its gen.py): an 8-GPU/8-NIC NVIDIA node and an MI300X node with AMD
//! Pollara NICs, both with one NIC per GPU on the GPU's PCIe switch and
//! four GPUs per socket.

use std::path::{Path, PathBuf};

use kvlane_data::topology::{link, GpuVendor, Link, Topology};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/topology")
        .join(name)
}

fn check_node(t: &Topology, vendor: GpuVendor, nic_prefix: &str) {
    assert_eq!(t.gpus.len(), 8, "{t:#?}");
    assert_eq!(t.nics.len(), 8, "{t:#?}");
    for (i, g) in t.gpus.iter().enumerate() {
        assert_eq!(g.index, i);
        assert_eq!(g.vendor, vendor);
        let expect_numa = if i < 4 { 0 } else { 1 };
        assert_eq!(g.pci.numa_node, Some(expect_numa), "GPU{i}");
        // Its own NIC shares its switch; the nearest is that one alone.
        let near = t.nearest_nics(&g.pci);
        assert_eq!(near.len(), 1, "GPU{i}: {near:?}");
        assert_eq!(near[0].name, format!("{nic_prefix}{i}"), "GPU{i}");
        for (j, n) in t.nics.iter().enumerate() {
            let l = link(&g.pci, n.pci.as_ref().expect("PCI NIC"));
            let want = if i == j {
                Link::Pix
            } else if (i < 4) == (j < 4) {
                Link::Node
            } else {
                Link::Sys
            };
            assert_eq!(l, want, "GPU{i} - {}", n.name);
        }
        // Distance order: own NIC, then the three on the socket, then the rest.
        let order: Vec<Link> = t.nics_by_distance(&g.pci).iter().map(|&(_, l)| l).collect();
        assert_eq!(order[0], Link::Pix);
        assert!(order[1..4].iter().all(|&l| l == Link::Node), "{order:?}");
        assert!(order[4..].iter().all(|&l| l == Link::Sys), "{order:?}");
    }
}

#[test]
fn nvidia_node_pairs_each_gpu_with_the_nic_on_its_switch() {
    let t = Topology::from_sysfs(&fixture("dgx-h100")).unwrap();
    check_node(&t, GpuVendor::Nvidia, "mlx5_");
    // CUDA spells bus ids with an 8-digit domain in upper case.
    let g = t
        .gpu_by_address("00000000:1B:00.0")
        .expect("GPU0 by bus id");
    assert_eq!(g.index, 0);
    assert_eq!(g.pci.device, 0x2330);
    assert_eq!(t.nics[0].pci.as_ref().unwrap().vendor, 0x15b3);
}

#[test]
fn mi300x_node_pairs_each_gpu_with_its_pollara_nic() {
    let t = Topology::from_sysfs(&fixture("mi300x-pollara")).unwrap();
    check_node(&t, GpuVendor::Amd, "ionic_");
    assert_eq!(
        t.gpus[0].pci.class >> 8,
        0x1200,
        "MI300X is a processing accelerator"
    );
    assert_eq!(t.nics[7].pci.as_ref().unwrap().vendor, 0x1dd8);
}

#[test]
fn the_matrix_names_every_gpu_and_nic_with_its_link() {
    let t = Topology::from_sysfs(&fixture("dgx-h100")).unwrap();
    let m = t.matrix();
    let lines: Vec<&str> = m.lines().collect();
    assert_eq!(lines.len(), 9, "{m}");
    assert!(
        lines[0].contains("mlx5_0") && lines[0].contains("mlx5_7"),
        "{m}"
    );
    let gpu3: Vec<&str> = lines[4].split_whitespace().collect();
    assert_eq!(
        gpu3,
        [
            "GPU3",
            "0000:4b:00.0",
            "0",
            "NODE",
            "NODE",
            "NODE",
            "PIX",
            "SYS",
            "SYS",
            "SYS",
            "SYS"
        ],
        "{m}"
    );
}

#[test]
fn a_tree_without_pci_or_rdma_is_empty_not_an_error() {
    let dir = std::env::temp_dir().join(format!("kvlane-topo-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = Topology::from_sysfs(&dir).unwrap();
    assert!(t.gpus.is_empty() && t.nics.is_empty());
    assert!(t.nearest_nics(&fake_gpu()).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_software_nic_has_no_pci_function_and_ranks_last() {
    let dir = std::env::temp_dir().join(format!("kvlane-topo-rxe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("class/infiniband/rxe0")).unwrap();
    let t = Topology::from_sysfs(&dir).unwrap();
    assert_eq!(t.nics.len(), 1);
    assert_eq!(t.nics[0].name, "rxe0");
    assert!(t.nics[0].pci.is_none());
    assert_eq!(t.nics_by_distance(&fake_gpu())[0].1, Link::Sys);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupt_class_file_is_a_parse_error_naming_it() {
    let dir = std::env::temp_dir().join(format!("kvlane-topo-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dev = dir.join("devices/pci0000:00/0000:00:02.0");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::create_dir_all(dir.join("bus/pci/devices")).unwrap();
    for (f, v) in [("class", "zz"), ("vendor", "0x10de"), ("device", "0x2330")] {
        std::fs::write(dev.join(f), v).unwrap();
    }
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:00/0000:00:02.0",
        dir.join("bus/pci/devices/0000:00:02.0"),
    )
    .unwrap();
    let e = Topology::from_sysfs(&dir).unwrap_err().to_string();
    assert!(
        e.contains("class") && e.contains("`zz` is not a hex number"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn this_machine_scans_without_error() {
    // Whatever /sys holds here (no GPU, no RDMA on the CI machine), the
    // scan reads it; every GPU it finds has a normalized bus id.
    let t = Topology::scan().unwrap();
    for g in &t.gpus {
        assert_eq!(
            t.gpu_by_address(&g.pci.address).map(|x| x.index),
            Some(g.index)
        );
    }
}

fn fake_gpu() -> kvlane_data::topology::PciDevice {
    kvlane_data::topology::PciDevice {
        address: "0000:1b:00.0".into(),
        vendor: 0x10de,
        device: 0x2330,
        class: 0x030200,
        numa_node: Some(0),
        host_bridge: "pci0000:18".into(),
        bridges: vec!["0000:18:01.0".into()],
    }
}

#[test]
fn a_gpus_nearest_rail_is_the_nic_on_its_switch() {
    let t = Topology::from_sysfs(&fixture("dgx-h100")).unwrap();
    let rails = [
        "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7",
    ];
    for g in &t.gpus {
        assert_eq!(
            t.nearest_rails(&g.pci.address, &rails),
            [g.index],
            "GPU{}",
            g.index
        );
    }
    // Rails that are a subset (KVLANE_IB_DEVICES=mlx5_1,mlx5_6): GPU0's
    // nearest is mlx5_1 (same socket), GPU7's is mlx5_6.
    let gpu = |i: usize| t.gpus[i].pci.address.clone();
    assert_eq!(t.nearest_rails(&gpu(0), &["mlx5_1", "mlx5_6"]), [0]);
    assert_eq!(t.nearest_rails(&gpu(7), &["mlx5_1", "mlx5_6"]), [1]);
    // Two rails on GPU0's socket tie.
    assert_eq!(
        t.nearest_rails(&gpu(0), &["mlx5_2", "mlx5_3", "mlx5_5"]),
        [0, 1]
    );
    // The bus id as CUDA prints it (upper case, 8-digit domain) works too.
    let cuda_style = format!("0000{}", gpu(3).to_ascii_uppercase());
    assert_eq!(t.nearest_rails(&cuda_style, &rails), [3]);
    // tcp rails, or a GPU that is not in the tree: no preference.
    assert!(t.nearest_rails(&gpu(0), &["tcp:10.0.0.1:0"]).is_empty());
    assert!(t.nearest_rails("0000:ff:00.0", &rails).is_empty());
}
