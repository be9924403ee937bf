#!/usr/bin/env python3
"""Writes the sysfs fixture trees the topology tests read.

Each tree is the part of /sys that kvlane's topology scan looks at:
`devices/pciDDDD:BB/...` (PCIe hierarchy: root port, switch, endpoints,
each with `class`, `vendor`, `device`, `numa_node`), `bus/pci/devices/BDF`
links into it, and `class/infiniband/NAME/device` links to each RDMA NIC.
The shapes follow published block diagrams of the two node types: every
GPU shares a PCIe switch with one NIC, four GPUs per CPU socket.
Re-run after editing; the output is committed.

    python3 gen.py   # rewrites ./dgx-h100 and ./mi300x-pollara
"""
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))

BRIDGE = ("0x060400", "0x8086", "0x352a")  # root port
SWITCH = ("0x060400", "0x1000", "0xc030")  # Broadcom PEX89000 switch port


def write_dev(path, cls, vendor, device, numa):
    os.makedirs(path, exist_ok=True)
    for name, value in (("class", cls), ("vendor", vendor), ("device", device),
                        ("numa_node", str(numa))):
        with open(os.path.join(path, name), "w") as f:
            f.write(value + "\n")


def link(target, at):
    os.makedirs(os.path.dirname(at), exist_ok=True)
    os.symlink(os.path.relpath(target, os.path.dirname(at)), at)


def node(name, gpu, nic, nic_name, roots):
    """roots: list of (numa, root bus); one GPU + one NIC under each."""
    top = os.path.join(HERE, name)
    shutil.rmtree(top, ignore_errors=True)
    bus_dir = os.path.join(top, "bus/pci/devices")
    os.makedirs(bus_dir)
    for i, (numa, rb) in enumerate(roots):
        root = os.path.join(top, "devices", f"pci0000:{rb:02x}")
        os.makedirs(root)
        rp = f"0000:{rb:02x}:01.0"
        up = f"0000:{rb + 1:02x}:00.0"
        dn_gpu = f"0000:{rb + 2:02x}:00.0"
        dn_nic = f"0000:{rb + 2:02x}:01.0"
        gpu_bdf = f"0000:{rb + 3:02x}:00.0"
        nic_bdf = f"0000:{rb + 4:02x}:00.0"
        p_rp = os.path.join(root, rp)
        p_up = os.path.join(p_rp, up)
        p_dg = os.path.join(p_up, dn_gpu)
        p_dn = os.path.join(p_up, dn_nic)
        p_gpu = os.path.join(p_dg, gpu_bdf)
        p_nic = os.path.join(p_dn, nic_bdf)
        write_dev(p_rp, *BRIDGE, numa)
        for p in (p_up, p_dg, p_dn):
            write_dev(p, *SWITCH, numa)
        write_dev(p_gpu, *gpu, numa)
        write_dev(p_nic, *nic, numa)
        for bdf, p in ((rp, p_rp), (up, p_up), (dn_gpu, p_dg), (dn_nic, p_dn),
                       (gpu_bdf, p_gpu), (nic_bdf, p_nic)):
            link(p, os.path.join(bus_dir, bdf))
        ib = os.path.join(top, "class/infiniband", f"{nic_name}{i}")
        os.makedirs(ib)
        link(p_nic, os.path.join(ib, "device"))


# DGX H100-like: 8 x H100 SXM (3D controller), 8 x ConnectX-7 (InfiniBand).
node("dgx-h100", ("0x030200", "0x10de", "0x2330"), ("0x020700", "0x15b3", "0x1021"),
     "mlx5_", [(0, 0x18), (0, 0x28), (0, 0x38), (0, 0x48),
               (1, 0x98), (1, 0xa8), (1, 0xb8), (1, 0xc8)])
# MI300X platform with AMD Pollara 400 NICs (Pensando, ionic driver); the
# MI300X enumerates as a processing accelerator (class 0x1200).
node("mi300x-pollara", ("0x120000", "0x1002", "0x74a1"), ("0x020000", "0x1dd8", "0x1002"),
     "ionic_", [(0, 0x05), (0, 0x15), (0, 0x65), (0, 0x75),
                (1, 0x85), (1, 0x95), (1, 0xe5), (1, 0xf5)])
