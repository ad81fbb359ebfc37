//! Whole pipelines through `weir run`: the file source, SQL filter and
//! select, string keys and running sums, and the stdout sink's guarantee.

use std::collections::{BTreeMap, HashSet};

use crate::common::*;

const ORDERS: &str = "name: orders
parallelism: 2
checkpoint:
  interval: 100ms
source:
  file:
    path: in
    schema: {id: int64, user: string, amount: float64}
    batch_size: 100
steps:
  - filter: amount >= 10
  - select: [id, user, \"amount * 2 AS doubled\"]
  - key_by: user
  - running_sum: {field: doubled, as: total}
    id: totals
sink:
  file:
    path: out/orders
";

#[test]
fn file_source_filter_select_and_string_keyed_sums_produce_the_expected_totals() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("in")).unwrap();
    let mut expected: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    let mut kept = HashSet::new();
    for f in 0..3 {
        let mut text = String::new();
        for i in 0..1000 {
            let id = f * 1000 + i;
            let user = format!("user-{}", id % 7);
            let amount = (id % 23) as f64;
            text.push_str(&format!("{{\"id\": {id}, \"user\": \"{user}\", \"amount\": {amount}}}\n"));
            if amount >= 10.0 {
                kept.insert(id as i64);
                let e = expected.entry(user).or_default();
                e.0 += 1;
                e.1 += amount * 2.0;
            }
        }
        std::fs::write(dir.path().join(format!("in/part-{f}.jsonl")), text).unwrap();
    }
    std::fs::write(dir.path().join("p.yaml"), ORDERS).unwrap();
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));

    let mut ids = HashSet::new();
    let mut per_user: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for e in std::fs::read_dir(dir.path().join("out/orders")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        assert!(!name.ends_with(".inprogress"), "in-progress file left: {name}");
        if name.starts_with('.') {
            continue; // the run lock of the output directory
        }
        for line in std::fs::read_to_string(e.path()).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert!(v.get("amount").is_none(), "select kept a dropped field: {line}");
            assert!(ids.insert(v["id"].as_i64().unwrap()), "id twice: {line}");
            per_user.entry(v["user"].as_str().unwrap().to_string()).or_default().push(v["total"].as_f64().unwrap());
        }
    }
    assert_eq!(ids, kept);
    for (user, (n, sum)) in expected {
        let totals = &per_user[&user];
        assert_eq!(totals.len(), n, "{user}");
        let max = totals.iter().cloned().fold(f64::MIN, f64::max);
        assert!((max - sum).abs() < 1e-6, "{user}: final total {max}, expected {sum}");
    }
}

#[test]
fn the_stdout_sink_prints_records_and_says_it_is_at_least_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("p.yaml"),
        "name: s\nsource:\n  generator: {events: 5, keys: 2}\nsteps:\n  - filter: seq > 1\nsink:\n  stdout: {}\n",
    )
    .unwrap();
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("guarantee at-least-once"), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut seqs: Vec<i64> = stdout
        .lines()
        .filter(|l| l.contains("\"seq\"") && !l.contains("records_in"))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"].as_i64().unwrap())
        .collect();
    seqs.sort();
    assert_eq!(seqs, vec![2, 3, 4]);
}

#[test]
fn weir_plan_prints_stages_and_state_ids_and_refuses_a_bad_pipeline_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("orders.yaml");
    std::fs::write(&good, ORDERS).unwrap();
    let out = std::process::Command::new(WEIR).args(["plan", "--parallelism", "3"]).arg(&good).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("job orders: 2 stages at parallelism 3"), "{text}");
    assert!(text.contains("hash by [user] into stage 1"), "{text}");
    assert!(text.contains("totals (steps[3].running_sum): running sum of doubled per [user]"), "{text}");
    assert!(text.lines().last().unwrap().starts_with("state ids: source, sink, in-flight-1, totals"), "{text}");
    // Nothing ran: no state directory and no output.
    assert!(!dir.path().join("weir-state").exists() && !dir.path().join("out").exists());

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, ORDERS.replace("key_by: user", "key_by: customer")).unwrap();
    let out = std::process::Command::new(WEIR).arg("plan").arg(&bad).output().unwrap();
    let err = assert_refused(&out);
    let line = ORDERS.lines().position(|l| l.contains("key_by")).unwrap() + 1;
    assert!(err.contains(&format!("bad.yaml:{line}: steps[2].key_by: no field `customer` to key by")), "{err}");
}
