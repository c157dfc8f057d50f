//! `forkbox bench ...`: the benchmarks are `forkbox-bench`'s; the CLI parses
//! them and hands in what its image flags choose (the guest image, the API
//! over the local data directory).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;

use crate::api::Api;
use crate::{EgressArgs, ImageArgs};

/// The data directory and the image flags of one benchmark.
struct CliTarget {
    home: PathBuf,
    image: ImageArgs,
}

impl forkbox_bench::Target for CliTarget {
    fn image(&self) -> Result<(PathBuf, String)> {
        crate::run::ensure_image(&self.home, &self.image, true)
    }

    fn api(&self) -> Result<Box<dyn forkbox_bench::Api>> {
        Ok(Box::new(Api::embedded(&self.home, &self.image, &EgressArgs::default())?))
    }
}

impl forkbox_bench::Api for Api {
    fn client(&self) -> &forkbox_client::Client {
        &self.client
    }

    fn target(&self) -> &str {
        &self.target
    }

    fn run(&self, f: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + '_>>) {
        self.block_on(f)
    }
}

pub fn bench(home: &Path, cmd: forkbox_bench::BenchCommand<ImageArgs>) -> Result<ExitCode> {
    forkbox_bench::bench(home, cmd, &|image| Box::new(CliTarget { home: home.to_path_buf(), image }))
}
