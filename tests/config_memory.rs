//! What a large config costs to hold and to load, counted by this test binary's allocator: a
//! per-customer file is held as its compiled rules, and loading it never also holds the whole
//! file as parsed YAML (a 100,000-descriptor file peaked at 491 MiB of allocations that way,
//! for 180 MiB of rules).
#![allow(unsafe_code)] // A counting global allocator is unsafe by its trait; nothing else here is.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Counts live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        if size > layout.size() {
            grow(size - layout.size());
        } else {
            LIVE.fetch_sub(layout.size() - size, Relaxed);
        }
        unsafe { System.realloc(ptr, layout, size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The only test in this binary, so no other test's allocations are counted with it.
#[test]
fn a_large_config_is_held_as_compiled_rules_and_loaded_without_a_parsed_copy() {
    const CUSTOMERS: usize = 10_000;
    let mut text = String::from("domain: big\ndescriptors:\n");
    for i in 0..CUSTOMERS {
        text.push_str(&format!(
            "  - key: customer\n    value: customer-{i:06}\n    rate_limit: {{unit: minute, requests_per_unit: 100}}\n    descriptors:\n      - key: path\n        value: /api/v1/orders\n        rate_limit: {{unit: second, requests_per_unit: 10}}\n"
        ));
    }
    let file = std::path::Path::new("big.yaml");
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let domain = ratelimitd::testing::compile_file(file, &text).expect("a valid config");
    let (peak, kept) = (PEAK.load(Relaxed) - before, LIVE.load(Relaxed) - before);
    drop(domain);
    let per_customer = kept / CUSTOMERS;
    eprintln!("{CUSTOMERS} customers: kept {kept} B ({per_customer} B each), peak {peak} B");
    assert!(
        per_customer < 1024,
        "each customer (two nodes, two limits) holds {per_customer} bytes"
    );
    assert!(
        peak < kept + kept / 2,
        "loading peaked at {peak} bytes for {kept} bytes of rules"
    );
}
