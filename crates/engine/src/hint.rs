//! The hint line a `ModuleNotFoundError` ends with: where the missing module is
//! (a shipped template has it) or how to get it (pip in a session). Added to the
//! exec result here, below every front end, so the CLI, the API and MCP say the same.

use forkbox_image::ImageSpec;

/// Longest module name a hint is made for (the name comes from the guest).
const MAX_MODULE: usize = 100;

/// Import names whose Debian package (`python3-<x>`) is named otherwise.
const DEBIAN_IMPORT: &[(&str, &str)] = &[("pil", "PIL")];
/// Import names whose PyPI distribution is named otherwise.
const PIP_NAME: &[(&str, &str)] =
    &[("PIL", "Pillow"), ("yaml", "PyYAML"), ("sklearn", "scikit-learn"), ("bs4", "beautifulsoup4")];

/// The top-level modules the shipped `data` template adds to the default one
/// (from its Debian packages).
pub fn data_template_modules() -> Vec<String> {
    let base = ImageSpec::python_numpy().packages;
    ImageSpec::data()
        .packages
        .into_iter()
        .filter(|p| !base.contains(p))
        .filter_map(|p| p.strip_prefix("python3-").map(str::to_string))
        .map(|m| DEBIAN_IMPORT.iter().find(|(d, _)| *d == m).map_or(m, |(_, i)| (*i).to_string()))
        .collect()
}

/// The pip name of top-level module `module`.
fn pip_name(module: &str) -> &str {
    PIP_NAME.iter().find(|(m, _)| *m == module).map_or(module, |(_, p)| p)
}

/// The module a `ModuleNotFoundError` message names (`No module named 'a.b'` -> `a`),
/// if it is a plain dotted Python name.
fn missing_module(message: &str) -> Option<&str> {
    let name = message.strip_prefix("No module named '")?.strip_suffix('\'')?;
    let top = name.split('.').next()?;
    let ok = !top.is_empty()
        && top.len() <= MAX_MODULE
        && !top.as_bytes()[0].is_ascii_digit()
        && top.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    ok.then_some(top)
}

/// The hint line for an exception of type `kind` with `message`, if there is one.
pub fn module_hint(kind: &str, message: &str) -> Option<String> {
    if kind != "ModuleNotFoundError" {
        return None;
    }
    let module = missing_module(message)?;
    let pip = pip_name(module);
    if data_template_modules().iter().any(|m| m == module) {
        Some(format!(
            "hint: {module} is in the shipped `data` template (--template data / template: \"data\"), \
             or install it in a session with %pip install {pip}"
        ))
    } else {
        Some(format!("hint: if {pip} is a package on PyPI, install it in a session with %pip install {pip}"))
    }
}

/// Append the hint line to a traceback (once).
pub fn add_to_traceback(kind: &str, message: &str, traceback: &mut String) {
    if let Some(h) = module_hint(kind, message) {
        if traceback.lines().last() == Some(h.as_str()) {
            return;
        }
        if !traceback.is_empty() && !traceback.ends_with('\n') {
            traceback.push('\n');
        }
        traceback.push_str(&h);
        traceback.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_modules_and_pip_names() {
        let m = data_template_modules();
        for want in ["pandas", "scipy", "matplotlib", "PIL", "sklearn", "yaml", "bs4"] {
            assert!(m.iter().any(|x| x == want), "{want} missing from {m:?}");
        }
        assert!(!m.iter().any(|x| x == "numpy"), "numpy is in the default template: {m:?}");
        let h = module_hint("ModuleNotFoundError", "No module named 'pandas'").unwrap();
        assert!(h.contains("`data` template") && h.ends_with("%pip install pandas"), "{h}");
        let h = module_hint("ModuleNotFoundError", "No module named 'PIL.Image'").unwrap();
        assert!(h.contains("PIL is in the shipped") && h.ends_with("%pip install Pillow"), "{h}");
        let h = module_hint("ModuleNotFoundError", "No module named 'httpx'").unwrap();
        assert!(!h.contains("template") && h.ends_with("%pip install httpx"), "{h}");
    }

    #[test]
    fn hostile_messages_get_no_hint() {
        assert_eq!(module_hint("ImportError", "No module named 'pandas'"), None);
        assert_eq!(module_hint("ModuleNotFoundError", "No module named 'a b; rm -rf /'"), None);
        assert_eq!(module_hint("ModuleNotFoundError", &format!("No module named '{}'", "x".repeat(200))), None);
        assert_eq!(module_hint("ModuleNotFoundError", "something else"), None);
        let mut tb = "Traceback\nModuleNotFoundError: No module named 'scipy'".to_string();
        add_to_traceback("ModuleNotFoundError", "No module named 'scipy'", &mut tb);
        add_to_traceback("ModuleNotFoundError", "No module named 'scipy'", &mut tb);
        assert_eq!(tb.matches("hint:").count(), 1, "{tb}");
        assert!(tb.trim_end().lines().last().unwrap().starts_with("hint: scipy"), "{tb}");
    }
}
