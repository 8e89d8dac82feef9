//! The git commit the binary is built from, for `starwire --version` and
//! the `starwire_build_info` metric: the environment variable
//! `STARWIRE_GIT_COMMIT` when the build sets it (a container build has no
//! `.git`), else the short hash of HEAD, or `unknown` when the source is
//! not a git checkout or git is missing. (Changes not committed are not
//! marked: the script reruns when HEAD moves, not on every edit.)

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    Some(s.trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=STARWIRE_GIT_COMMIT");
    let given = std::env::var("STARWIRE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty() && c.trim() != "unknown");
    if let Some(c) = given {
        println!("cargo:rustc-env=STARWIRE_GIT_COMMIT={}", c.trim());
        return;
    }
    let commit = git(&["rev-parse", "--short=12", "HEAD"]);
    // Rebuild when HEAD moves: HEAD itself, the branch it names, and the
    // packed refs. Without git, cargo's default (any file of the package)
    // applies.
    if commit.is_some() {
        for p in ["HEAD", "packed-refs"] {
            if let Some(path) = git(&["rev-parse", "--git-path", p]) {
                println!("cargo:rerun-if-changed={path}");
            }
        }
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            if let Some(path) = git(&["rev-parse", "--git-path", &branch]) {
                if Path::new(&path).exists() {
                    println!("cargo:rerun-if-changed={path}");
                }
            }
        }
        println!("cargo:rerun-if-changed=build.rs");
    }
    println!(
        "cargo:rustc-env=STARWIRE_GIT_COMMIT={}",
        commit.as_deref().unwrap_or("unknown")
    );
}
