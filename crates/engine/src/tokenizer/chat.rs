//! Chat templates: Jinja templates from the model, rendered with minijinja the way
//! transformers' `apply_chat_template` renders them (trim_blocks + lstrip_blocks, Python string
//! methods, `raise_exception`, `strftime_now`, a `tojson` that writes what Python's
//! `json.dumps` writes). A model's template is untrusted input: it renders on a thread of its
//! own within limits on instructions, output, time and memory (`TEMPLATE_LIMITS`; the memory
//! bound needs `alloc_guard::GuardedAlloc` installed).

use super::{ChatMessage, Tokenizer};
use crate::alloc_guard::{run_bounded, Limits};
use crate::{Error, Result};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use std::time::Duration;

/// End-of-turn markers of common chat formats. One that the template writes and the
/// vocabulary has ends generation just as EOS does.
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "</s>",
];

/// Gemma's chat format, for GGUFs of the Gemma family that carry no template (llama.cpp
/// falls back to the same built-in format): a system message is prepended to the first user
/// turn, the assistant's role is "model", turns end in <end_of_turn>.
pub(super) const GEMMA_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for m in turns -%}
{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + (prefix if loop.first else '') }}
{{- m['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}<start_of_turn>model
{% endif -%}"#;

/// The built-in template for a GGUF architecture that comes without one.
pub(super) fn builtin_template(arch: &str) -> Option<&'static str> {
    arch.starts_with("gemma").then_some(GEMMA_TEMPLATE)
}

/// EOS, the file's extra stop ids, and every end-of-turn marker the template uses (or, with
/// no template, every one the vocabulary has).
pub(super) fn stop_ids(
    hf: &tokenizers::Tokenizer,
    eos: Option<u32>,
    extra: &[u32],
    template: Option<&str>,
) -> Vec<u32> {
    let mut out: Vec<u32> = eos.into_iter().chain(extra.iter().copied()).collect();
    // Without a template there is no telling which marker the model was tuned on: take every
    // one the vocabulary has.
    // Only special (control) tokens count: Gemma's "</s>" is a user-defined HTML tag.
    let special: std::collections::HashMap<String, u32> =
        hf.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, t)| (t.content, id)).collect();
    for m in END_OF_TURN.iter().filter(|m| template.is_none_or(|t| t.contains(*m))) {
        out.extend(special.get(*m));
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|id| seen.insert(*id));
    out
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)`: ", " and ": " separators when
/// compact, "," + newline + indent when indented, "[]"/"{}" when empty, non-ASCII as is.
fn py_dumps(v: &serde_json::Value, indent: Option<&str>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                py_dumps(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::from(k.as_str()).to_string());
                out.push_str(": ");
                py_dumps(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        // Scalars, "[]" and "{}": serde_json writes these as Python does.
        other => out.push_str(&other.to_string()),
    }
}

fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    py_dumps(&json, indent.as_deref(), 0, &mut out);
    Ok(Value::from(out))
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `datetime.now().strftime(fmt)` for the directives chat templates use, in UTC.
pub(super) fn strftime(fmt: &str, unix_secs: i64) -> std::result::Result<String, minijinja::Error> {
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let dir = it.next().unwrap_or('%');
        let h12 = if h % 12 == 0 { 12 } else { h % 12 };
        match dir {
            'Y' => out += &y.to_string(),
            'y' => out += &format!("{:02}", y.rem_euclid(100)),
            'm' => out += &format!("{m:02}"),
            'd' => out += &format!("{d:02}"),
            'e' => out += &format!("{d:>2}"),
            '-' if it.clone().next() == Some('d') => {
                it.next();
                out += &d.to_string()
            }
            'j' => out += &format!("{yday:03}"),
            'H' => out += &format!("{h:02}"),
            'I' => out += &format!("{h12:02}"),
            'M' => out += &format!("{mi:02}"),
            'S' => out += &format!("{s:02}"),
            'p' => out += if h < 12 { "AM" } else { "PM" },
            'B' => out += month,
            'b' | 'h' => out += &month[..3],
            'A' => out += DAYS[wday],
            'a' => out += &DAYS[wday][..3],
            'F' => out += &format!("{y}-{m:02}-{d:02}"),
            'T' => out += &format!("{h:02}:{mi:02}:{s:02}"),
            '%' => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: directive %{other} is not supported"),
                ))
            }
        }
    }
    Ok(out)
}

fn strftime_now(fmt: String) -> std::result::Result<String, minijinja::Error> {
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(&fmt, now)
}

/// Instructions a chat template may run for one rendering: real templates take a few
/// hundred per message; a template that loops without end runs out in well under a second.
const TEMPLATE_FUEL: u64 = 20_000_000;
/// Bytes a rendered prompt may have.
const TEMPLATE_OUTPUT_MAX: usize = 64 << 20;
/// Memory one rendering may hold (4× the output cap: a template that doubles a string or a
/// list reaches it in a few steps) and the time its caller waits. The memory bound needs
/// `GuardedAlloc` as the global allocator (the CLI installs it); see `crate::alloc_guard`.
const TEMPLATE_LIMITS: Limits = Limits { memory: 256 << 20, time: Duration::from_secs(10) };

pub(super) fn apply(tok: &Tokenizer, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
    let src = tok
        .chat_template
        .as_deref()
        .ok_or_else(|| Error::Invalid(format!("{}: the model has no chat template", tok.source)))?;
    let s = &tok.specials;
    let ctx = minijinja::context! {
        messages => Value::from_serialize(messages),
        add_generation_prompt => add_generation_prompt,
        bos_token => s.bos.clone(),
        eos_token => s.eos.clone(),
        unk_token => s.unk.clone(),
        pad_token => s.pad.clone(),
    };
    render(src, ctx).map_err(|e| Error::format(&tok.source, format!("chat template: {e}")))
}

/// Render a model's template as transformers does, within `TEMPLATE_FUEL` instructions,
/// `TEMPLATE_OUTPUT_MAX` bytes of output and `TEMPLATE_LIMITS`.
fn render(src: &str, ctx: Value) -> std::result::Result<String, String> {
    render_within(src, ctx, TEMPLATE_LIMITS)
}

/// `render` on a thread of its own, its memory and time bounded by `limits`.
fn render_within(src: &str, ctx: Value, limits: Limits) -> std::result::Result<String, String> {
    warm_up();
    let src = src.to_string();
    run_bounded(limits, move || render_here(&src, ctx)).unwrap_or_else(|e| Err(format!("{e} while rendering")))
}

/// Fill minijinja's process-wide caches before any rendering runs under a budget: one
/// parked (out of memory) inside such a cache's initialization would block every later
/// rendering.
fn warm_up() {
    static WARM: std::sync::Once = std::sync::Once::new();
    WARM.call_once(|| {
        let _ = render_here("{{ 1 }}{{ [1, 'a'] | tojson }}", minijinja::context! {});
    });
}

/// The rendering itself, on the calling thread.
fn render_here(src: &str, ctx: Value) -> std::result::Result<String, String> {
    // `{:#}` adds minijinja's pointer into the template source.
    let err = |e: minijinja::Error| match e.kind() {
        ErrorKind::OutOfFuel => format!("runs more than {TEMPLATE_FUEL} instructions (an endless loop?)"),
        _ => format!("{e:#}"),
    };
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    let tmpl = env.template_from_str(src).map_err(err)?;
    let mut out = CappedOutput { text: Vec::new(), full: false };
    let rendered = tmpl.render_captured_to(ctx, &mut out).map(|_| ());
    match rendered {
        Ok(_) => String::from_utf8(out.text).map_err(|_| "rendered invalid UTF-8".to_string()),
        Err(_) if out.full => Err(format!("renders more than {TEMPLATE_OUTPUT_MAX} bytes")),
        Err(e) => Err(err(e)),
    }
}

/// A writer that fails, keeping nothing more, once more than `TEMPLATE_OUTPUT_MAX` bytes
/// are written to it.
struct CappedOutput {
    text: Vec<u8>,
    full: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + b.len() > TEMPLATE_OUTPUT_MAX {
            self.full = true;
            return Err(std::io::Error::other("template output past its limit"));
        }
        self.text.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_python() {
        // python: datetime.fromtimestamp(0, timezone.utc).strftime(...)
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %A %a %B %j %I%p %y %e %%", t).unwrap(),
            "2024-02-29 13:05:09 Thursday Thu February 060 01PM 24 29 %"
        );
        assert_eq!(strftime("%-d %B", t).unwrap(), "29 February");
        assert!(strftime("%Q", t).is_err());
    }

    /// Hostile templates end with an error naming the limit: one that loops without end
    /// (out of fuel) and one that writes without end (past the output cap); a normal one
    /// renders.
    #[test]
    fn templates_render_within_limits() {
        let ctx = minijinja::context! { messages => vec!["hi"] };
        let t = std::time::Instant::now();
        let endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let e = render(endless, ctx.clone());
        assert!(e.unwrap_err().contains("instructions"), "an endless loop runs out of fuel");
        assert!(t.elapsed().as_secs() < 30, "fuel ran for {:?}", t.elapsed());
        let big = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}";
        assert!(render(big, ctx.clone()).unwrap_err().contains("bytes"), "100 MB of output is refused");
        assert_eq!(render("{{ messages[0] }}!", ctx.clone()).unwrap(), "hi!");
        let quick = Limits { time: Duration::from_millis(1), ..TEMPLATE_LIMITS };
        let e = render_within(endless, ctx, quick).unwrap_err();
        assert_eq!(e, "took more than 0.001 s while rendering");
    }

    /// Templates that double a string or a list (through a namespace, or a macro's
    /// recursion) stop at the memory budget in moments (the lib's tests install
    /// GuardedAlloc); rendering goes on working after each.
    #[test]
    fn templates_that_double_stop_at_the_memory_budget() {
        let ctx = minijinja::context! { messages => vec!["hi"] };
        let small = Limits { memory: 16 << 20, ..TEMPLATE_LIMITS };
        for t in DOUBLING {
            let start = std::time::Instant::now();
            let e = render_within(t, ctx.clone(), small).unwrap_err();
            assert_eq!(e, "used more than 16 MiB while rendering", "{t}");
            assert!(start.elapsed().as_secs() < 5, "{t}: {:?}", start.elapsed());
            assert_eq!(render("{{ messages[0] }}!", ctx.clone()).unwrap(), "hi!");
        }
    }

    /// Hostile templates that double a string or a list 45 times (2⁴⁵ bytes). (`l + l`
    /// alone is lazy in minijinja: `|list` makes it a list.)
    const DOUBLING: [&str; 3] = [
        "{% set ns = namespace(s='x') %}{% for i in range(45) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(45) %}{% set ns.l = (ns.l + ns.l)|list %}{% endfor %}{{ ns.l|length }}",
        "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}{% endmacro %}{{ f('x', 45) }}",
    ];

    #[test]
    fn tojson_matches_python_json_dumps() {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        let ctx = minijinja::context! { x => serde_json::json!({"a": [1, 2.5, {}], "b": "é\n<"}) };
        let r = |src: &str| env.render_str(src, &ctx).unwrap();
        // python: json.dumps(x, ensure_ascii=False) / json.dumps(x, ensure_ascii=False, indent=2)
        assert_eq!(r("{{ x | tojson }}"), r#"{"a": [1, 2.5, {}], "b": "é\n<"}"#);
        assert_eq!(
            r("{{ x | tojson(indent=2) }}"),
            "{\n  \"a\": [\n    1,\n    2.5,\n    {}\n  ],\n  \"b\": \"é\\n<\"\n}"
        );
        assert!(env.render_str("{{ x | tojson(bogus=1) }}", &ctx).is_err());
    }
}
