//! The serving router's modules import each other without a cycle: every
//! `crate::module` reference (outside comments and `#[cfg(test)]` code) is an edge
//! between top-level modules, every `super::sibling` reference an edge between
//! siblings of a directory module, and neither graph may have a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The file's code outside comments and its `#[cfg(test)]` tail.
fn code(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split("//").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

/// Identifiers that follow `prefix` (e.g. `crate::`) in `code`, including those of a
/// braced group right after it (`crate::{a, b::c}`).
fn targets(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in code.match_indices(prefix) {
        let rest = &code[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let name = ident(part.trim());
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// Source files of module `dir/name` (`name.rs`, or `name/**.rs`).
fn module_files(src: &Path, name: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let file = src.join(format!("{name}.rs"));
    if file.is_file() {
        files.push(file);
    }
    let dir = src.join(name);
    if dir.is_dir() {
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).expect("read dir").flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
    }
    files
}

/// The names of the modules directly in `dir` (files and directories, minus
/// `lib.rs`/`mod.rs`/`main.rs`).
fn modules_in(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .expect("read src")
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let stem = p.file_stem()?.to_str()?.to_string();
            let is_mod = p.is_dir() || p.extension().is_some_and(|x| x == "rs");
            (is_mod && !matches!(stem.as_str(), "lib" | "mod" | "main")).then_some(stem)
        })
        .collect()
}

/// A cycle in `graph`, if any, as the list of its nodes.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let start = path.iter().position(|p| p == m).unwrap_or(0);
                    let mut cycle = path[start..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, graph, state, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `crate::` edges between the top-level modules of `src`.
fn crate_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules_in(src);
    modules
        .iter()
        .map(|m| {
            let deps: BTreeSet<String> = module_files(src, m)
                .iter()
                .flat_map(|f| targets(&code(f), "crate::"))
                .filter(|t| t != m && modules.contains(t))
                .collect();
            (m.clone(), deps)
        })
        .collect()
}

/// `super::` edges between the sibling modules of directory module `dir`.
fn sibling_graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let siblings = modules_in(dir);
    siblings
        .iter()
        .map(|m| {
            let deps: BTreeSet<String> = module_files(dir, m)
                .iter()
                .flat_map(|f| targets(&code(f), "super::"))
                .filter(|t| t != m && siblings.contains(t))
                .collect();
            (m.clone(), deps)
        })
        .collect()
}

#[test]
fn the_checker_finds_a_planted_cycle() {
    let dir = std::env::temp_dir().join(format!("kvfleet-cycles-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("temp dir");
    fs::write(dir.join("lib.rs"), "pub mod a;\npub mod b;\npub mod c;\n").expect("write");
    fs::write(
        dir.join("a.rs"),
        "use crate::b::B;\n// crate::c in a comment\n",
    )
    .expect("write");
    fs::write(dir.join("b.rs"), "use crate::{c::C, a};\n").expect("write");
    fs::write(
        dir.join("c.rs"),
        "pub struct C;\n#[cfg(test)]\nuse crate::a;\n",
    )
    .expect("write");
    let g = crate_graph(&dir);
    assert_eq!(g["a"], BTreeSet::from(["b".to_string()]));
    assert_eq!(g["c"], BTreeSet::new(), "test code is no edge");
    let cycle = find_cycle(&g).expect("a ↔ b");
    assert_eq!(cycle.first(), cycle.last());
    assert!(cycle.contains(&"a".to_string()) && cycle.contains(&"b".to_string()));
    fs::write(dir.join("b.rs"), "use crate::c::C;\n").expect("write");
    assert_eq!(find_cycle(&crate_graph(&dir)), None);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn no_import_cycle_between_top_level_modules() {
    let g = crate_graph(&src());
    assert!(
        g.contains_key("fleet") && g.contains_key("dispatch"),
        "{g:?}"
    );
    if let Some(c) = find_cycle(&g) {
        panic!("module import cycle: {}", c.join(" → "));
    }
}

#[test]
fn no_import_cycle_between_sibling_submodules() {
    for m in modules_in(&src()) {
        let dir = src().join(&m);
        if dir.is_dir() {
            if let Some(c) = find_cycle(&sibling_graph(&dir)) {
                panic!("import cycle inside {m}: {}", c.join(" → "));
            }
        }
    }
}
