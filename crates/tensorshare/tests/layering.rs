//! One direction of travel: the library's top-level modules form layers, and a module
//! imports only from its own layer or the ones below. An import that goes up needs a reason,
//! written where it happens as a `// layering: <reason>` comment on its line or just above
//! it; no module imports another in a circle except through such an import; and no source
//! file grows past `MAX_LINES` without a reason written here.
//!
//! The test reads the sources (`src/` of this crate) and looks at every path that leaves a
//! top-level module: `crate::x`, `crate::{x, y}`, `crate::Name` (a re-export of the crate
//! root, resolved to the module it comes from) and `super::` paths that climb to the root.
//! Comments and string literals are not code and are skipped.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The layers, lowest first. A module may import from its own layer (without a circle) and
/// from the layers below. README, "How it works", describes them.
const LAYERS: &[&[&str]] = &[
    // Helpers every module may use: random bytes, a lock that survives poisoning, the
    // registry of fork guards.
    &["util"],
    // The crate's error type, which every module returns.
    &["error"],
    // Plain data and primitives: element types, devices, atomic byte copies, thread names.
    &["dtype", "device", "atomic_bytes", "thread"],
    // The sharing strategy (memfd or named segments).
    &["strategy"],
    // OS shared memory: segments, cleanup groups.
    &["shm"],
    // Arenas of slots in segments; the public tools of the shared-memory directory.
    &["arena", "segments"],
    // Device memory (feature `cuda`).
    &["cuda"],
    // Reference-counted bytes, private or shared.
    &["storage"],
    // Dense tensors over storages.
    &["tensor"],
    // Tensors made of tensors.
    &["sparse", "nested"],
    // Named tensors over one storage (a model's weights), and their files.
    &["weights"],
    // Conversions to and from other libraries (features `dlpack`, `candle`, `burn`).
    &["interop"],
    // The codec: values to bytes plus descriptors, and back.
    &["wire"],
    // Queues and pipes between processes.
    &["channel"],
    // The cross-language value (what a Python process exchanges), and messages for
    // transports that are not ours.
    &["value", "message"],
    // Workers, pools, the cleaner.
    &["process"],
    // Distributed communication on MPI (feature `mpi`): ranks of a job, above everything a
    // single process does.
    &["dist"],
];

/// Files longer than this need a reason (below): split them by concept instead.
const MAX_LINES: usize = 400;

/// Files allowed over `MAX_LINES`, each with its reason.
const LONG_FILES: &[(&str, &str)] = &[];

const MARK: &str = "// layering:";

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `text` with comments and string and character literals blanked out (newlines kept),
/// so that what is left is code and line numbers stay the same.
fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, s: &[char]| {
        for &ch in s {
            out.push(if ch == '\n' { '\n' } else { ' ' });
        }
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let rest = &c[i..];
        if rest.starts_with(&['/', '/']) {
            let end = rest.iter().position(|&ch| ch == '\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(&['/', '*']) {
            let (mut depth, mut j) = (0, 0);
            while j < rest.len() {
                if rest[j..].starts_with(&['/', '*']) {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(&['*', '/']) {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &rest[..j]);
            i += j;
        } else if c[i] == 'r'
            && (i == 0 || !ident(c[i - 1]) || (c[i - 1] == 'b' && (i < 2 || !ident(c[i - 2]))))
            && rest.get(1).is_some_and(|&ch| ch == '"' || ch == '#')
        {
            let hashes = rest[1..].iter().take_while(|&&ch| ch == '#').count();
            if rest.get(1 + hashes) != Some(&'"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            let mut j = 2 + hashes;
            while j < rest.len()
                && !(rest[j] == '"'
                    && rest[j + 1..].iter().take(hashes).filter(|&&h| h == '#').count() == hashes)
            {
                j += 1;
            }
            let end = (j + 1 + hashes).min(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if c[i] == '"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if c[i] == '\'' {
            // A character literal ('x', '\n', '\u{1F600}'), or a lifetime ('a), kept.
            let len = if rest.get(1) == Some(&'\\') {
                rest[2..].iter().position(|&ch| ch == '\'').map(|p| p + 3)
            } else if rest.get(2) == Some(&'\'') {
                Some(3)
            } else {
                None
            };
            match len {
                Some(n) => {
                    blank(&mut out, &rest[..n]);
                    i += n;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn is_ident(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// One path that leaves the module it is written in.
#[derive(Debug)]
struct Reference {
    file: String,
    /// 1-based.
    line: usize,
    from: String,
    /// The first name after `crate::` (or after the `super::`s that reach the root).
    name: String,
}

/// The module path of `rel` (relative to `src/`): `shm/group.rs` is `[shm, group]`,
/// `shm/mod.rs` and `shm.rs` are `[shm]`.
fn module_path(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(str::to_owned).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// Every path in `code` (stripped) that names something at the crate root.
fn references(rel: &str, code: &str) -> Vec<Reference> {
    let c: Vec<char> = code.chars().collect();
    let file_path = module_path(rel);
    let from = file_path[0].clone();
    let mut out = Vec::new();
    let mut line = 1;
    let mut depth = 0usize;
    // Inline modules (`mod tests { .. }`): their brace depth.
    let mut inline: Vec<usize> = Vec::new();
    let mut pending_mod = false;
    let word_at = |i: usize, w: &str| {
        let w: Vec<char> = w.chars().collect();
        c[i..].starts_with(&w) && (i == 0 || !(is_ident(c[i - 1]) || c[i - 1] == ':' || c[i - 1] == '$'))
    };
    let skip_ws = |mut i: usize| {
        while i < c.len() && c[i].is_whitespace() {
            i += 1;
        }
        i
    };
    let read_ident = |i: usize| {
        let end = c[i..].iter().position(|&ch| !is_ident(ch)).map_or(c.len(), |p| i + p);
        (c[i..end].iter().collect::<String>(), end)
    };
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '\n' => line += 1,
            '{' => {
                depth += 1;
                if pending_mod {
                    inline.push(depth);
                    pending_mod = false;
                }
            }
            '}' => {
                if inline.last() == Some(&depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            ';' => pending_mod = false,
            _ => {}
        }
        if word_at(i, "mod ") {
            pending_mod = true;
        }
        let mut at_root = None;
        let mut next = i + 1;
        if word_at(i, "crate::") {
            at_root = Some(i + "crate::".len());
        } else if word_at(i, "super::") {
            let mut j = i;
            let mut ups = 0;
            while c[j..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
                ups += 1;
                j += "super::".len();
            }
            // Climbing out of every module the file and its inline modules make: the root.
            if ups == file_path.len() + inline.len() {
                at_root = Some(j);
            }
            next = j;
        }
        if let Some(j) = at_root {
            let j = skip_ws(j);
            let mut names = Vec::new();
            if c.get(j) == Some(&'{') {
                // `crate::{a, b::c, d::{e, f}}`: the first name of each item.
                let (mut k, mut d, mut expect) = (j, 0, true);
                while k < c.len() {
                    match c[k] {
                        '{' => {
                            d += 1;
                            expect = d == 1;
                        }
                        '}' => {
                            d -= 1;
                            if d == 0 {
                                break;
                            }
                        }
                        ',' if d == 1 => expect = true,
                        ch if expect && is_ident(ch) => {
                            let (name, end) = read_ident(k);
                            names.push(name);
                            expect = false;
                            k = end;
                            continue;
                        }
                        _ => {}
                    }
                    k += 1;
                }
            } else if c.get(j).copied().is_some_and(is_ident) {
                names.push(read_ident(j).0);
            }
            for name in names.into_iter().filter(|n| n != "self") {
                out.push(Reference { file: rel.to_owned(), line, from: from.clone(), name });
            }
        }
        i = next;
    }
    out
}

/// The names the crate root re-exports (`pub use m::{A, B}` makes `A` and `B` name `m`)
/// and defines itself (as `lib`).
fn root_names(lib: &str, modules: &BTreeSet<String>) -> HashMap<String, String> {
    let mut names = HashMap::new();
    for stmt in lib.split(';') {
        let stmt = stmt.trim();
        if let Some(rest) = stmt.strip_prefix("pub use ") {
            let module = rest.split("::").next().unwrap_or("").trim().to_owned();
            if !modules.contains(&module) {
                continue;
            }
            let tail = &rest[module.len()..];
            let words: Vec<&str> = tail.split(|ch: char| !is_ident(ch)).filter(|w| !w.is_empty()).collect();
            for (k, w) in words.iter().enumerate() {
                let renamed = words.get(k + 1) == Some(&"as");
                if *w != "as" && *w != "self" && !renamed {
                    names.insert((*w).to_owned(), module.clone());
                }
            }
        }
    }
    for kw in ["fn ", "mod ", "const ", "static ", "struct ", "enum ", "type ", "trait "] {
        for (pos, _) in lib.match_indices(kw) {
            if pos > 0 && is_ident(lib[..pos].chars().last().unwrap_or(' ')) {
                continue;
            }
            let name: String = lib[pos + kw.len()..].chars().take_while(|&ch| is_ident(ch)).collect();
            if !name.is_empty() && !modules.contains(&name) {
                names.insert(name, "lib".to_owned());
            }
        }
    }
    names
}

/// Whether the reference on `line` (1-based) has a reason: a `// layering: <reason>`
/// comment on that line or in the comments and attributes just above it. Returns the line
/// of that comment.
fn reason_for(lines: &[&str], line: usize) -> Option<usize> {
    let has_mark = |l: &str| l.find(MARK).is_some_and(|p| !l[p + MARK.len()..].trim().is_empty());
    if has_mark(lines[line - 1]) {
        return Some(line);
    }
    let mut k = line - 1;
    while k > 0 {
        let l = lines[k - 1].trim_start();
        if !(l.starts_with("//") || l.starts_with("#[")) {
            return None;
        }
        if has_mark(l) {
            return Some(k);
        }
        k -= 1;
    }
    None
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// What the check finds wrong in the sources under `src`, one line each.
fn check(src: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let rank: HashMap<&str, usize> =
        LAYERS.iter().enumerate().flat_map(|(r, layer)| layer.iter().map(move |m| (*m, r))).collect();
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let rel = |p: &Path| p.strip_prefix(src).expect("under src").to_string_lossy().replace('\\', "/");
    let modules: BTreeSet<String> =
        files.iter().map(|p| rel(p)).filter(|r| r != "lib.rs").map(|r| module_path(&r)[0].clone()).collect();
    for m in &modules {
        if !rank.contains_key(m.as_str()) {
            problems
                .push(format!("module `{m}` is in no layer: add it to LAYERS (and to README, How it works)"));
        }
    }
    for m in rank.keys() {
        if !modules.contains(*m) {
            problems.push(format!("LAYERS names `{m}`, which is no module of src/"));
        }
    }
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read lib.rs");
    let names = root_names(&strip(&lib), &modules);
    let top = LAYERS.len();
    let rank_of = |m: &str| if m == "lib" { top } else { rank.get(m).copied().unwrap_or(top) };

    // Edges between modules without a written reason, for the circle check.
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in &files {
        let rel = rel(path);
        let text = std::fs::read_to_string(path).expect("read a source file");
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() > MAX_LINES && !LONG_FILES.iter().any(|(f, _)| *f == rel) {
            problems.push(format!(
                "{rel} has {} lines, more than {MAX_LINES}: split it by concept (or give a reason in LONG_FILES)",
                lines.len()
            ));
        }
        if rel == "lib.rs" {
            continue; // the root assembles the layers; it is above them all
        }
        let mut used_marks = BTreeSet::new();
        for r in references(&rel, &strip(&text)) {
            let Some(to) =
                (if modules.contains(&r.name) { Some(r.name.clone()) } else { names.get(&r.name).cloned() })
            else {
                problems.push(format!(
                    "{}:{}: `crate::{}` names nothing this test knows",
                    r.file, r.line, r.name
                ));
                continue;
            };
            if to == r.from {
                continue;
            }
            let upward = rank_of(&r.from) < rank_of(&to);
            match reason_for(&lines, r.line) {
                Some(mark) if upward => {
                    used_marks.insert(mark);
                }
                Some(_) => {
                    edges.entry(r.from.clone()).or_default().insert(to);
                }
                None if upward => problems.push(format!(
                    "{}:{}: `{}` (layer {}) imports `{}` from `{to}` (layer {}), a higher layer, without a \
                     `{MARK} <reason>` comment on or just above the line",
                    r.file,
                    r.line,
                    r.from,
                    rank_of(&r.from),
                    r.name,
                    rank_of(&to)
                )),
                None => {
                    edges.entry(r.from.clone()).or_default().insert(to);
                }
            }
        }
        for (k, l) in lines.iter().enumerate() {
            if l.contains(MARK) && !used_marks.contains(&(k + 1)) {
                problems.push(format!(
                    "{rel}:{}: a `{MARK}` comment that justifies no import from a higher layer: remove it",
                    k + 1
                ));
            }
        }
    }
    if let Some(cycle) = find_cycle(&edges) {
        problems.push(format!(
            "modules import each other in a circle: {} (break it, or write the reason on the upward import)",
            cycle.join(" -> ")
        ));
    }
    problems
}

/// A circle in `edges`, as the modules along it (the first repeated at the end).
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_owned());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, edges, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges.keys().find_map(|m| visit(m, edges, &mut done, &mut Vec::new()))
}

#[test]
fn modules_import_only_downward_or_with_a_written_reason() {
    let problems = check(&src_dir());
    assert!(problems.is_empty(), "layering:\n{}", problems.join("\n"));
}

/// The check itself, on small made-up crates: it must see what it is for.
mod the_check {
    use super::*;

    /// A crate in a temporary directory: `files` as (path under src/, contents).
    fn crate_with(files: &[(&str, &str)]) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tensorshare-layering-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    /// Every module of LAYERS as an empty file, plus `extra` (replacing one of them).
    fn layered(extra: &[(&str, &str)]) -> Vec<String> {
        let mut files: Vec<(String, String)> = LAYERS
            .iter()
            .flat_map(|l| l.iter())
            .map(|m| (format!("{m}.rs"), String::new()))
            .filter(|(p, _)| !extra.iter().any(|(e, _)| e == p))
            .collect();
        files.push(("lib.rs".into(), "pub use error::{Error, Result};\npub use tensor::Tensor;\n".into()));
        files.extend(extra.iter().map(|(p, t)| (p.to_string(), t.to_string())));
        let refs: Vec<(&str, &str)> = files.iter().map(|(p, t)| (p.as_str(), t.as_str())).collect();
        let dir = crate_with(&refs);
        let problems = check(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        problems
    }

    #[test]
    fn downward_imports_pass() {
        let p = layered(&[(
            "process.rs",
            "use crate::channel::Queue;\nuse crate::{wire, Error, Result, Tensor};\nfn f() { crate::shm::x(); }\n",
        )]);
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn an_upward_import_without_a_reason_fails() {
        let p = layered(&[("shm.rs", "use crate::process::{self, Arrival};\n")]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("shm.rs:1") && p[0].contains("`process`"), "{p:?}");
        // Through a root re-export, in a group, in an expression, over lines.
        let p = layered(&[("shm.rs", "use crate::{\n    Error,\n    Tensor,\n};\n")]);
        assert!(p.len() == 1 && p[0].contains("shm.rs:1") && p[0].contains("`tensor`"), "{p:?}");
        let p = layered(&[("arena.rs", "fn f() {\n    let x = crate::wire::encode(&1);\n}\n")]);
        assert!(p.len() == 1 && p[0].contains("arena.rs:2"), "{p:?}");
        // `super::` that climbs to the root, from a nested file.
        let p = layered(&[
            ("shm/mod.rs", "mod group;\n"),
            ("shm/group.rs", "use super::super::channel::pair;\n"),
        ]);
        assert!(p.len() == 1 && p[0].contains("shm/group.rs:1"), "{p:?}");
    }

    #[test]
    fn a_written_reason_lets_an_import_go_up_but_a_stale_one_fails() {
        let p = layered(&[(
            "error.rs",
            "// layering: an error names the tensor it is about\nuse crate::tensor::Tensor;\n\
             fn f() { crate::wire::x(); } // layering: the codec's reason, kept\n",
        )]);
        assert!(p.is_empty(), "{p:?}");
        let p = layered(&[("process.rs", "// layering: not needed\nuse crate::shm::Segment;\n")]);
        assert!(p.len() == 1 && p[0].contains("justifies no import"), "{p:?}");
        let p = layered(&[("shm.rs", "// layering:\nuse crate::process::Worker;\n")]);
        assert_eq!(p.len(), 2, "an empty reason is none: {p:?}");
    }

    #[test]
    fn comments_strings_and_inner_modules_are_not_imports() {
        let p = layered(&[(
            "util.rs",
            "//! see [`crate::process`]\nconst S: &str = \"crate::process\";\nconst R: &str = r#\"crate::wire\"#;\n\
             /* crate::channel */\nfn f<'a>(c: char) -> bool { c == '\"' }\nmod fork {\n    use super::lock;\n}\n\
             fn lock() {}\n",
        )]);
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn a_circle_among_peers_fails() {
        let p =
            layered(&[("sparse.rs", "use crate::nested::N;\n"), ("nested.rs", "use crate::sparse::S;\n")]);
        assert!(p.len() == 1 && p[0].contains("circle"), "{p:?}");
    }

    #[test]
    fn modules_outside_the_layers_and_long_files_fail() {
        let p = layered(&[("newthing.rs", "")]);
        assert!(p.len() == 1 && p[0].contains("`newthing` is in no layer"), "{p:?}");
        let long = "fn f() {}\n".repeat(MAX_LINES + 1);
        let p = layered(&[("storage.rs", long.as_str())]);
        assert!(p.len() == 1 && p[0].contains("storage.rs has"), "{p:?}");
    }
}
