//! List an image like `ls -lR`: `cargo run -p forkbox-image --example image_ls -- IMAGE [PATH]`

use forkbox_image::{Image, NodeKind};

fn walk(img: &Image, ino: u32, path: &mut Vec<u8>) {
    for (name, c) in img.children(ino) {
        let len = path.len();
        path.push(b'/');
        path.extend_from_slice(name);
        if let Some(m) = img.meta(c) {
            let (k, extra) = match m.kind {
                NodeKind::Dir => ('d', String::new()),
                NodeKind::File => ('-', String::new()),
                NodeKind::Symlink => {
                    ('l', format!(" -> {}", String::from_utf8_lossy(img.read_link(c).unwrap_or_default())))
                }
            };
            println!("{k} {:04o} {:>10} {:>11} {}{extra}", m.perm, m.size, m.mtime, String::from_utf8_lossy(path));
            if m.kind == NodeKind::Dir {
                walk(img, c, path);
            }
        }
        path.truncate(len);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let img = Image::open(std::path::Path::new(args.get(1).ok_or("usage: image_ls IMAGE [DIR]")?))?;
    let mut ino = Image::ROOT;
    let start = args.get(2).cloned().unwrap_or_default();
    for c in start.split('/').filter(|c| !c.is_empty()) {
        ino = img.lookup(ino, c.as_bytes()).ok_or("no such path")?;
    }
    eprintln!("id {} content {} inodes {}", img.id(), img.content_hash(), img.inode_count());
    walk(&img, ino, &mut start.trim_end_matches('/').as_bytes().to_vec());
    Ok(())
}
