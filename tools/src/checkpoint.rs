//! `starwire checkpoint`: read a checkpoint directory without the job that
//! wrote it (`inspect`), and bring a full shard file to a delta's step
//! (`apply-delta`) for export or serving, as PS-Plus's online-learning
//! users do with its incremental exports. A restart never applies deltas:
//! it restores the manifest's full checkpoint.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use starwire_ps::delta::DeltaHeader;
use starwire_ps::layout::ShardLayout;
use starwire_ps::{write_atomic, CheckpointError, Manifest};

/// `starwire checkpoint`.
#[derive(Debug, clap::Args)]
pub struct CheckpointArgs {
    #[command(subcommand)]
    cmd: CheckpointCmd,
}

#[derive(Debug, clap::Subcommand)]
enum CheckpointCmd {
    /// The manifest of a checkpoint directory, each shard file's global
    /// step, variables and rows, and the deltas present.
    Inspect {
        /// The checkpoint directory (a --checkpoint-dir).
        dir: PathBuf,
    },
    /// Write the full shard file a delta brings its base to: the base's
    /// state with the delta's rows, variables and counters (for export or
    /// serving).
    ApplyDelta {
        /// The base: the full shard file of the delta's base step.
        #[arg(long, value_name = "FILE")]
        base: PathBuf,
        /// The delta (DIR/deltas/C/shard-NNNN.delta).
        #[arg(long, value_name = "FILE")]
        delta: PathBuf,
        /// Where the full shard file goes (written atomically).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn at(path: &Path) -> impl Fn(CheckpointError) -> String + '_ {
    move |e| format!("{}: {e}", path.display())
}

/// Run `starwire checkpoint`.
pub fn main(a: CheckpointArgs) -> Result<(), String> {
    match a.cmd {
        CheckpointCmd::Inspect { dir } => {
            print!("{}", inspect(&dir)?);
            Ok(())
        }
        CheckpointCmd::ApplyDelta { base, delta, out } => {
            let step = apply_delta(&base, &delta, &out)?;
            println!(
                "{}: the shard at global step {step} ({} + {})",
                out.display(),
                base.display(),
                delta.display()
            );
            Ok(())
        }
    }
}

/// The text `inspect` prints.
fn inspect(dir: &Path) -> Result<String, String> {
    let mpath = dir.join("manifest.json");
    let text = std::fs::read_to_string(&mpath).map_err(|e| format!("{}: {e}", mpath.display()))?;
    let m = Manifest::from_json(&text).map_err(at(&mpath))?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: format {}, global step {}, {} shard(s), seed {}",
        mpath.display(),
        m.format_version,
        m.global_step,
        m.shard_count,
        m.seed
    );
    for p in &m.workers {
        let _ = writeln!(
            s,
            "  worker {}: epoch {}, offset {}, steps {}, examples {}",
            p.worker, p.epoch, p.offset, p.steps, p.examples
        );
    }
    for (i, f) in m.shard_files.iter().enumerate() {
        let path = dir.join(f);
        let l = ShardLayout::parse(&read(&path)?).map_err(at(&path))?;
        let rows: u64 = l.vars.iter().map(|v| v.rows).sum();
        let _ = writeln!(
            s,
            "shard {i}: {f}: format {}, global step {}, optimizer {:?}, {} variable(s), {rows} row(s)",
            l.version,
            l.global_step,
            l.optimizer,
            l.vars.len()
        );
        for v in &l.vars {
            let _ = match v.embedding {
                true => writeln!(
                    s,
                    "  variable {}: embedding, dim {}, {} row(s), {} pending",
                    v.id, v.width, v.rows, v.pending
                ),
                false => writeln!(s, "  variable {}: dense, {} value(s)", v.id, v.width),
            };
        }
        for (w, p) in &l.workers {
            let _ = writeln!(
                s,
                "  worker {w}: {} step(s) applied (+{} push(es))",
                p.steps, p.parts
            );
        }
    }
    for (path, h) in deltas(dir)? {
        let _ = writeln!(
            s,
            "delta {}: shard {}, global step {} on the full checkpoint of step {}",
            path.strip_prefix(dir).unwrap_or(&path).display(),
            h.shard_index,
            h.step,
            h.base
        );
    }
    Ok(s)
}

/// Every delta file under `dir/deltas/`, with its header, by path.
fn deltas(dir: &Path) -> Result<Vec<(PathBuf, DeltaHeader)>, String> {
    let root = dir.join("deltas");
    let Ok(steps) = std::fs::read_dir(&root) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for step in steps.flatten() {
        let Ok(files) = std::fs::read_dir(step.path()) else {
            continue;
        };
        for f in files.flatten() {
            let path = f.path();
            if path.extension().is_some_and(|e| e == "delta") {
                let h = DeltaHeader::parse(&read(&path)?).map_err(at(&path))?;
                out.push((path, h));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Restore `base` into a shard of its own layout, apply `delta`, write
/// the result to `out`; the global step it holds.
fn apply_delta(base: &Path, delta: &Path, out: &Path) -> Result<u64, String> {
    let data = read(base)?;
    let mut shard = ShardLayout::parse(&data)
        .and_then(|l| l.shard())
        .map_err(at(base))?;
    shard.restore(&mut data.as_slice()).map_err(at(base))?;
    shard
        .apply_delta(&mut read(delta)?.as_slice())
        .map_err(at(delta))?;
    write_atomic(out, |w| shard.save(w)).map_err(at(out))?;
    Ok(shard.global_step())
}
