//! Manual end-to-end build of the default python3 + numpy image (downloads ~25 MB).
//! `cargo run -p forkbox-image --example build_image [-- --home DIR] [--quiet]`

use forkbox_image::{build, default_home, BuildOptions, Image, ImageSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let home = args
        .iter()
        .position(|a| a == "--home")
        .and_then(|i| args.get(i + 1))
        .map(Into::into)
        .unwrap_or_else(default_home);
    let progress = !args.iter().any(|a| a == "--quiet");
    let t = std::time::Instant::now();
    let built = build(&ImageSpec::python_numpy(), &BuildOptions { home, progress, report: None })?;
    println!("id {}\npath {}\nreused {}\nelapsed {:?}", built.id, built.path.display(), built.reused, t.elapsed());
    println!("packages {}: {}", built.packages.len(), built.packages.join(" "));
    if let Some(s) = &built.stats {
        println!("{s:#?}");
    }
    let img = Image::open(&built.path)?;
    println!("inodes {} size {}", img.inode_count(), std::fs::metadata(&built.path)?.len());
    Ok(())
}
