//! Find DPDK with pkg-config, compile the C shim against its headers, and
//! generate bindings for the allow-listed API into `OUT_DIR`.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// The DPDK release the bindings are written for (Debian 12's).
const MIN_VERSION: &str = "22.11";

fn main() {
    println!("cargo:rerun-if-changed=src/shim.h");
    println!("cargo:rerun-if-changed=src/shim.c");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let lib = pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .probe("libdpdk")
        .unwrap_or_else(|e| {
            panic!(
                "starwire-dpdk-sys needs DPDK >= {MIN_VERSION} found by pkg-config \
                 (Debian: apt-get install libdpdk-dev pkg-config): {e}"
            )
        });
    // The pkg-config crate keeps only -I and -D; DPDK's headers also need
    // `-include rte_config.h` and the instruction set they were built for.
    let cflags = cflags();

    let mut cc = cc::Build::new();
    cc.file("src/shim.c").warnings(false).opt_level(2);
    for f in &cflags {
        cc.flag(f);
    }
    cc.compile("starwire_dpdk_shim");

    let mut b = bindgen::Builder::default()
        .header("src/shim.h")
        .clang_args(&cflags)
        .allowlist_function("sw_.*")
        .allowlist_function(
            "rte_eal_(init|cleanup)|rte_strerror|rte_thread_(register|unregister)|rte_socket_id",
        )
        .allowlist_function(
            "rte_eth_(dev_count_avail|dev_is_valid_port|dev_info_get|dev_configure\
             |dev_adjust_nb_rx_tx_desc|rx_queue_setup|tx_queue_setup|dev_start|dev_stop\
             |dev_close|dev_socket_id|macaddr_get|link_get_nowait|dev_get_mtu|stats_get\
             |xstats_get|xstats_get_names|dev_get_name_by_port)",
        )
        .allowlist_function("rte_pktmbuf_pool_create|rte_mempool_(free|avail_count|in_use_count)")
        .allowlist_var("RTE_ETH_LINK_(UP|DOWN|FULL_DUPLEX)|RTE_MBUF_DEFAULT_BUF_SIZE")
        .allowlist_var("RTE_PKTMBUF_HEADROOM|RTE_MAX_LCORE|LCORE_ID_ANY|RTE_ETH_NAME_MAX_LEN")
        .allowlist_var("RTE_MEMPOOL_CACHE_MAX_SIZE|SOCKET_ID_ANY|RTE_ETH_XSTATS_NAME_SIZE")
        // The mbuf's layout is the shim's business: Rust sees a pointer.
        .opaque_type("rte_mbuf")
        .opaque_type("rte_mempool")
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for p in &lib.include_paths {
        b = b.clang_arg(format!("-I{}", p.display()));
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    b.generate()
        .unwrap_or_else(|e| panic!("bindgen failed on DPDK's headers: {e}"))
        .write_to_file(out.join("bindings.rs"))
        .unwrap_or_else(|e| panic!("writing bindings.rs: {e}"));
}

/// `pkg-config --cflags libdpdk`, split on whitespace.
fn cflags() -> Vec<String> {
    let pkg_config = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_owned());
    let out = Command::new(&pkg_config)
        .args(["--cflags", "libdpdk"])
        .output()
        .unwrap_or_else(|e| panic!("running {pkg_config}: {e}"));
    assert!(
        out.status.success(),
        "{pkg_config} --cflags libdpdk failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}
