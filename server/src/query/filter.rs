//! Filters: a CEL expression over `key` and `value`, parsed by the `cel`
//! crate (behind [`parse`]), checked against the map's types once per call,
//! and compiled into a tree that reads members straight from an entry's
//! bytes: no JSON, no `Value` tree, no allocation per entry.
//!
//! What compiles: member paths and indexes, integer, bool, string and bytes
//! literals, lists of them, comparisons, `&&`, `||`, `!`, `? :`, integer
//! `+ - * / %` and negation (exact, in 128 bits; overflow or a division by
//! zero is an error), `in` on a list literal (a sorted set),
//! and on strings (char arrays) `startsWith`, `endsWith`, `contains`,
//! `matches` (RE2 syntax, linear time: the `regex` crate) and `size`. A map
//! without types has bytes: `key.u32(0)`, `value.be16(4)`, ... read
//! integers at byte offsets. Everything else (comprehensions such as
//! `exists`, maps, timestamps, floats) is refused with INVALID_ARGUMENT.
//!
//! As in CEL, an error inside the expression (an overflow) makes `||` and
//! `&&` look at their other side (`true || error` is true), and an entry
//! whose filter ends in an error does not match.

use bpfmap_proto::typed::{
    BytesMember, EntryRef, IntField, IntMember, Literal, MapLayout, Member, MemberKind, Root, Step,
};
use cel::common::ast::{self, Expr, IdedExpr, LiteralValue, operators as op};

/// The longest filter accepted, in bytes.
pub const MAX_FILTER_LEN: usize = 4096;
/// The deepest nesting of an expression accepted (the parser's recursion
/// limit).
pub const MAX_FILTER_DEPTH: u16 = 32;
/// The most operators and operands one filter may have.
pub const MAX_FILTER_NODES: usize = 512;
/// The most elements of all list literals of one filter.
pub const MAX_LIST_ELEMENTS: usize = 10_000;
/// The longest regular expression, and its compiled size bound.
const MAX_REGEX_LEN: usize = 256;
const MAX_REGEX_SIZE: usize = 256 << 10;
/// The most regular expressions one filter may hold: each costs its
/// compilation (on the call's thread, a millisecond near the size bound)
/// and up to twice the compiled size bound (256 KiB) of memory for the call.
pub const MAX_REGEXES: usize = 8;

/// A filter that cannot be used: the message names the member or the
/// operator and where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("filter: {0}")]
pub struct FilterError(pub String);

#[path = "filter_scan.rs"]
mod scan;

/// A compiled filter.
#[derive(Debug)]
pub struct Filter {
    root: Node,
    /// Whether it reads the value (the walk can skip decoding otherwise).
    source: String,
}

/// The types the filter's values have.
#[derive(Debug, Clone, PartialEq)]
enum Ty {
    Int(String),
    Bool,
    Str,
    Bytes,
}

impl Ty {
    fn name(&self) -> String {
        match self {
            Self::Int(n) => n.clone(),
            Self::Bool => "bool".into(),
            Self::Str => "string".into(),
            Self::Bytes => "bytes".into(),
        }
    }

    fn same_kind(&self, other: &Ty) -> bool {
        matches!(
            (self, other),
            (Ty::Int(_), Ty::Int(_))
                | (Ty::Bool, Ty::Bool)
                | (Ty::Str, Ty::Str)
                | (Ty::Bytes, Ty::Bytes)
        )
    }
}

/// A value while evaluating.
#[derive(Debug, Clone, PartialEq)]
enum Val<'a> {
    Int(i128),
    Bool(bool),
    Bytes(&'a [u8]),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Cmp {
    #[inline]
    fn test<T: PartialOrd>(self, a: T, b: T) -> bool {
        match self {
            Cmp::Eq => a == b,
            Cmp::Ne => a != b,
            Cmp::Lt => a < b,
            Cmp::Le => a <= b,
            Cmp::Gt => a > b,
            Cmp::Ge => a >= b,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Arith {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
}

#[derive(Debug, Clone, Copy)]
enum StrFn {
    StartsWith,
    EndsWith,
    Contains,
}

#[derive(Debug)]
enum Node {
    Int(i128),
    Bool(bool),
    Bytes(Vec<u8>),
    LoadInt(IntMember),
    LoadBool(IntMember),
    LoadBytes(BytesMember),
    /// The fast path of the common case: a member against a constant.
    IntCmpConst(IntMember, Cmp, i128),
    Cmp(Cmp, Box<Node>, Box<Node>),
    Arith(Arith, Box<Node>, Box<Node>),
    Neg(Box<Node>),
    Not(Box<Node>),
    And(Vec<Node>),
    Or(Vec<Node>),
    Cond(Box<Node>, Box<Node>, Box<Node>),
    InInts(Box<Node>, Set<i128>),
    /// The fast path of `member in [1, 2, 3]`.
    IntInConsts(IntMember, Set<i128>),
    InBytes(Box<Node>, Set<Vec<u8>>),
    Str(StrFn, Box<Node>, Vec<u8>),
    Matches(Box<Node>, regex::bytes::Regex),
    Size(Box<Node>),
}

impl Filter {
    /// Parses and checks `source` against a map's `layout`.
    pub fn compile(source: &str, layout: &MapLayout) -> Result<Self, FilterError> {
        let (expr, info) = parse(source)?;
        let mut c = Compiler {
            layout,
            info: &info,
            source,
            nodes: 0,
            list_elements: 0,
            regexes: 0,
        };
        let (root, ty) = c.node(&expr)?;
        if ty != Ty::Bool {
            return Err(FilterError(format!(
                "the expression is {}, not bool: a filter says whether an entry is sent",
                ty.name()
            )));
        }
        Ok(Self {
            root,
            source: source.to_owned(),
        })
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether `entry` matches.
    #[inline]
    pub fn matches(&self, entry: &EntryRef<'_>) -> bool {
        matches!(eval(&self.root, entry), Some(Val::Bool(true)))
    }
}

/// Parses `source` with the parser's limits (length, nesting); the error
/// quotes the parser's message and position.
fn parse(source: &str) -> Result<(IdedExpr, ast::SourceInfo), FilterError> {
    if source.len() > MAX_FILTER_LEN {
        return Err(FilterError(format!(
            "{} bytes: a filter is at most {MAX_FILTER_LEN}",
            source.len()
        )));
    }
    // The parser recurses on nesting it has not checked yet (brackets and
    // unary operators): refuse deep nesting before it sees it.
    let mut depth = 0usize;
    let mut max = 0usize;
    for c in source.bytes() {
        match c {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        max = max.max(depth);
    }
    let unary = source.bytes().filter(|&c| c == b'!' || c == b'-').count();
    if max > usize::from(MAX_FILTER_DEPTH) || unary > MAX_FILTER_NODES {
        return Err(FilterError(format!(
            "nested too deeply: at most {MAX_FILTER_DEPTH} levels"
        )));
    }
    let parsed = std::panic::catch_unwind(|| {
        cel::parser::Parser::new()
            .max_recursion_depth(MAX_FILTER_DEPTH)
            .error_recovery_limit(4)
            .parse_with_source_info(source)
    });
    match parsed {
        Ok(Ok(x)) => Ok(x),
        Ok(Err(errors)) => {
            let first = errors.errors.first();
            Err(FilterError(match first {
                // The parser's positions count from 1.
                Some(e) => format!("{} (line {}, column {})", e.msg, e.pos.0, e.pos.1),
                None => "cannot be parsed".into(),
            }))
        }
        Err(_) => Err(FilterError("cannot be parsed".into())),
    }
}

/// "column C" of byte offset `at` (characters from its line's start, from
/// 1), with "line L, " first when `source` has more than one line.
fn position(source: &str, at: usize) -> String {
    let before = source.get(..at).unwrap_or(source);
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    if source.contains('\n') {
        let line = before.matches('\n').count() + 1;
        format!("line {line}, column {column}")
    } else {
        format!("column {column}")
    }
}

struct Compiler<'a> {
    layout: &'a MapLayout,
    info: &'a ast::SourceInfo,
    source: &'a str,
    nodes: usize,
    list_elements: usize,
    regexes: usize,
}

type Compiled = (Node, Ty);

impl Compiler<'_> {
    /// The source span of `e` and everything under it.
    fn span(&self, e: &IdedExpr, depth: usize) -> Option<(u32, u32)> {
        let mut span = self.info.offset_for(e.id);
        let mut widen = |s: Option<(u32, u32)>| {
            if let Some((a, b)) = s {
                span = Some(span.map_or((a, b), |(x, y)| (x.min(a), y.max(b))));
            }
        };
        if depth > usize::from(MAX_FILTER_DEPTH) * 2 {
            return span;
        }
        match &e.expr {
            Expr::Select(sel) => {
                // The node stands at the dot: the name follows it.
                if let Some((a, _)) = self.info.offset_for(e.id) {
                    widen(Some((a, a + sel.field.len() as u32)));
                }
                widen(self.span(&sel.operand, depth + 1));
            }
            Expr::Call(c) => {
                if let Some(t) = &c.target {
                    widen(self.span(t, depth + 1));
                }
                // A global call stands at its bracket: its name precedes it.
                if c.target.is_none()
                    && let Some((a, _)) = self.info.offset_for(e.id)
                    && self
                        .source
                        .as_bytes()
                        .get(..a as usize)
                        .is_some_and(|b| b.ends_with(c.func_name.as_bytes()))
                {
                    widen(Some((a - c.func_name.len() as u32, a)));
                }
                for a in &c.args {
                    widen(self.span(a, depth + 1));
                }
                // A call or an index ends at its closing bracket, which no
                // node stands on.
                if let Some((a, b)) = span
                    && (c.func_name == op::INDEX
                        || c.func_name.starts_with(|ch: char| ch.is_ascii_alphabetic()))
                {
                    span = Some((a, self.closing(b)));
                }
            }
            Expr::List(l) => {
                for x in &l.elements {
                    widen(self.span(x, depth + 1));
                }
                if let Some((a, b)) = span {
                    span = Some((a, self.closing(b)));
                }
            }
            Expr::Comprehension(c) => {
                widen(self.span(&c.iter_range, depth + 1));
                widen(self.span(&c.loop_step, depth + 1));
                if let Some((a, b)) = span {
                    span = Some((a, self.closing(b)));
                }
            }
            // The parser folds `-1` into a literal that stands on the 1.
            Expr::Literal(LiteralValue::Int(i)) if *i.inner() < 0 => {
                if let Some((a, b)) = span
                    && a > 0
                    && self.source.as_bytes().get(a as usize - 1) == Some(&b'-')
                {
                    span = Some((a - 1, b));
                }
            }
            _ => {}
        }
        span
    }

    /// The offset of the bracket that closes a call whose last argument
    /// ends at `stop` (`stop` itself when there is none).
    fn closing(&self, stop: u32) -> u32 {
        let rest = self
            .source
            .as_bytes()
            .get(stop as usize + 1..)
            .unwrap_or(&[]);
        let skip = rest.iter().take_while(|c| c.is_ascii_whitespace()).count();
        match rest.get(skip) {
            Some(b')' | b']') => stop + 1 + skip as u32,
            _ => stop,
        }
    }

    /// The text of `e` and where it starts, for messages: its column, and
    /// its line when the filter has more than one.
    fn at(&self, e: &IdedExpr) -> String {
        match self.span(e, 0) {
            Some((start, stop)) => {
                let (start, stop) = (start as usize, (stop as usize).max(start as usize));
                let end = (stop + 1).min(self.source.len());
                let text = self.source.get(start..end).unwrap_or("");
                let text: String = text.chars().take(64).collect();
                format!("{} ({})", text.trim(), position(self.source, start))
            }
            None => "the expression".into(),
        }
    }

    fn err(&self, e: &IdedExpr, msg: impl std::fmt::Display) -> FilterError {
        FilterError(format!("{}: {msg}", self.at(e)))
    }

    fn node(&mut self, e: &IdedExpr) -> Result<Compiled, FilterError> {
        self.nodes += 1;
        if self.nodes > MAX_FILTER_NODES {
            return Err(FilterError(format!(
                "too large: at most {MAX_FILTER_NODES} operators and operands"
            )));
        }
        match &e.expr {
            Expr::Literal(l) => self.literal(e, l),
            Expr::Select(s) if s.test => Err(self.err(
                &s.operand,
                "has() is not needed: a map's members are always present",
            )),
            Expr::Ident(_) | Expr::Select(_) => self.member(e),
            Expr::Call(call) => self.call(e, call),
            Expr::List(_) => Err(self.err(e, "a list is only allowed after `in`")),
            Expr::Comprehension(_) => Err(self.err(
                e,
                "comprehensions (all, exists, exists_one, map, filter) are not supported in filters",
            )),
            Expr::Map(_) | Expr::Struct(_) => Err(self.err(e, "maps and messages are not supported in filters")),
            Expr::Unspecified => Err(self.err(e, "cannot be compiled")),
        }
    }

    fn literal(&self, e: &IdedExpr, l: &LiteralValue) -> Result<Compiled, FilterError> {
        Ok(match l {
            LiteralValue::Int(i) => (Node::Int(i128::from(*i.inner())), Ty::Int("int".into())),
            LiteralValue::UInt(u) => (Node::Int(i128::from(*u.inner())), Ty::Int("uint".into())),
            LiteralValue::Boolean(b) => (Node::Bool(*b.inner()), Ty::Bool),
            LiteralValue::String(s) => (Node::Bytes(s.as_bytes().to_vec()), Ty::Str),
            LiteralValue::Bytes(b) => (Node::Bytes(b.to_vec()), Ty::Bytes),
            LiteralValue::Double(_) => {
                return Err(self.err(e, "floating-point numbers are not supported in filters"));
            }
            LiteralValue::Null => return Err(self.err(e, "null is not supported in filters")),
        })
    }

    /// A path: `key`, `value`, `values[i]`, then members and indexes.
    fn path(&self, e: &IdedExpr) -> Option<(Root, Vec<Step>)> {
        match &e.expr {
            Expr::Ident(n) => match n.as_str() {
                "key" => Some((Root::Key, Vec::new())),
                "value" => Some((Root::Value, Vec::new())),
                _ => None,
            },
            Expr::Select(s) if !s.test => {
                let (root, mut steps) = self.path(&s.operand)?;
                steps.push(Step::Member(s.field.clone()));
                Some((root, steps))
            }
            Expr::Call(c) if c.func_name == op::INDEX && c.args.len() == 2 => {
                let index = match &c.args[1].expr {
                    Expr::Literal(LiteralValue::Int(i)) => u64::try_from(*i.inner()).ok()?,
                    Expr::Literal(LiteralValue::UInt(u)) => *u.inner(),
                    _ => return None,
                };
                if let Expr::Ident(n) = &c.args[0].expr
                    && n == "values"
                {
                    return Some((Root::Cpu(usize::try_from(index).ok()?), Vec::new()));
                }
                let (root, mut steps) = self.path(&c.args[0])?;
                steps.push(Step::Index(index));
                Some((root, steps))
            }
            _ => None,
        }
    }

    fn member(&mut self, e: &IdedExpr) -> Result<Compiled, FilterError> {
        let Some((root, steps)) = self.path(e) else {
            // An index into something else: what that is says more.
            if let Expr::Call(c) = &e.expr
                && c.func_name == op::INDEX
                && let Some(inner) = c.args.first()
                && !matches!(inner.expr, Expr::Ident(_) | Expr::Select(_))
                && self.path(inner).is_none()
            {
                self.node(inner)?;
            }
            if let Expr::Ident(n) = &e.expr {
                return Err(self.err(
                    e,
                    format!("unknown name {n:?}: a filter reads key, value (and values[i] for per-CPU maps)"),
                ));
            }
            return Err(self.err(
                e,
                "not a member path (key.member, value.member[i], values[i].member)",
            ));
        };
        let m = self
            .layout
            .resolve(root, &steps)
            .map_err(|m| self.err(e, m))?;
        self.load(e, &m)
    }

    /// Reads a resolved member, by its kind.
    fn load(&self, e: &IdedExpr, m: &Member<'_>) -> Result<Compiled, FilterError> {
        let name = m.type_name();
        let bytes = || {
            m.bytes()
                .ok_or_else(|| self.err(e, format!("{} cannot be read as bytes", m.path())))
        };
        Ok(match m.kind() {
            MemberKind::Integer => (
                Node::LoadInt(m.int().map_err(|err| self.err(e, err))?),
                Ty::Int(name),
            ),
            MemberKind::Bool if !m.summed() => (
                Node::LoadBool(m.flag().map_err(|err| self.err(e, err))?),
                Ty::Bool,
            ),
            MemberKind::Text if !m.summed() => (Node::LoadBytes(bytes()?), Ty::Str),
            _ if m.summed() => return Err(self.err(e, m.not_summable())),
            MemberKind::Bytes => (Node::LoadBytes(bytes()?), Ty::Bytes),
            _ => {
                return Err(self.err(
                    e,
                    format!("{} is {name}, which a filter cannot compare (integers, enums, bools, char arrays and bytes can be)", m.path()),
                ));
            }
        })
    }

    fn call(&mut self, e: &IdedExpr, c: &ast::CallExpr) -> Result<Compiled, FilterError> {
        let name = c.func_name.as_str();
        if name == op::INDEX {
            return self.member(e);
        }
        if let Some(cmp) = match name {
            op::EQUALS => Some(Cmp::Eq),
            op::NOT_EQUALS => Some(Cmp::Ne),
            op::LESS => Some(Cmp::Lt),
            op::LESS_EQUALS => Some(Cmp::Le),
            op::GREATER => Some(Cmp::Gt),
            op::GREATER_EQUALS => Some(Cmp::Ge),
            _ => None,
        } {
            return self.compare(e, cmp, &c.args[0], &c.args[1]);
        }
        match name {
            op::LOGICAL_AND | op::LOGICAL_OR => self.logic(name, c),
            op::LOGICAL_NOT => {
                let (n, t) = self.node(&c.args[0])?;
                if t != Ty::Bool {
                    return Err(self.err(e, format!("`!` needs a bool, not {}", t.name())));
                }
                Ok((Node::Not(Box::new(n)), Ty::Bool))
            }
            op::NEGATE => {
                let (n, t) = self.node(&c.args[0])?;
                if !matches!(t, Ty::Int(_)) {
                    return Err(self.err(e, format!("`-` needs an integer, not {}", t.name())));
                }
                Ok((Node::Neg(Box::new(n)), Ty::Int("int".into())))
            }
            op::ADD | op::SUBSTRACT | op::MULTIPLY | op::DIVIDE | op::MODULO => {
                self.arithmetic(e, name, c)
            }
            op::CONDITIONAL => self.conditional(e, c),
            op::IN => self.within(e, &c.args[0], &c.args[1]),
            "startsWith" | "endsWith" | "contains" | "matches" | "size" => self.string_fn(e, c),
            "u8" | "u16" | "u32" | "u64" | "i8" | "i16" | "i32" | "i64" | "be16" | "be32"
            | "be64" => self.read_int(e, c),
            op::HAS => Err(self.err(e, "has() is not needed: a map's members are always present")),
            other => Err(self.err(
                e,
                format!("unknown function or operator {other:?} in a filter"),
            )),
        }
    }

    /// `&&` and `||` over conditions.
    fn logic(&mut self, name: &str, c: &ast::CallExpr) -> Result<Compiled, FilterError> {
        let mut parts = Vec::with_capacity(c.args.len());
        for a in &c.args {
            let (n, t) = self.node(a)?;
            if t != Ty::Bool {
                return Err(self.err(
                    a,
                    format!("is {}, not bool: `&&` and `||` join conditions", t.name()),
                ));
            }
            parts.push(n);
        }
        Ok((
            if name == op::LOGICAL_AND {
                Node::And(parts)
            } else {
                Node::Or(parts)
            },
            Ty::Bool,
        ))
    }

    /// `+ - * / %` on integers.
    fn arithmetic(
        &mut self,
        e: &IdedExpr,
        name: &str,
        c: &ast::CallExpr,
    ) -> Result<Compiled, FilterError> {
        let arith = match name {
            op::ADD => Arith::Add,
            op::SUBSTRACT => Arith::Sub,
            op::MULTIPLY => Arith::Mul,
            op::DIVIDE => Arith::Div,
            _ => Arith::Rem,
        };
        let (a, ta) = self.node(&c.args[0])?;
        let (b, tb) = self.node(&c.args[1])?;
        if !matches!((&ta, &tb), (Ty::Int(_), Ty::Int(_))) {
            return Err(self.err(
                e,
                format!("arithmetic is on integers: {} and {}", ta.name(), tb.name()),
            ));
        }
        Ok((
            Node::Arith(arith, Box::new(a), Box::new(b)),
            Ty::Int("int".into()),
        ))
    }

    /// `cond ? a : b`, whose branches have one kind.
    fn conditional(&mut self, e: &IdedExpr, c: &ast::CallExpr) -> Result<Compiled, FilterError> {
        let (cond, tc) = self.node(&c.args[0])?;
        if tc != Ty::Bool {
            return Err(self.err(
                &c.args[0],
                format!("is {}: the condition of `? :` is a bool", tc.name()),
            ));
        }
        let (a, ta) = self.node(&c.args[1])?;
        let (b, tb) = self.node(&c.args[2])?;
        if !ta.same_kind(&tb) {
            return Err(self.err(
                e,
                format!("the branches of `? :` are {} and {}", ta.name(), tb.name()),
            ));
        }
        Ok((Node::Cond(Box::new(cond), Box::new(a), Box::new(b)), ta))
    }

    /// `key.u32(0)`, `u32(value, 4)`: an integer at a byte offset of an
    /// untyped key or value.
    fn read_int(&mut self, e: &IdedExpr, c: &ast::CallExpr) -> Result<Compiled, FilterError> {
        let (target, offset) = match (&c.target, c.args.as_slice()) {
            (Some(t), [off]) => (t.as_ref(), off),
            (None, [t, off]) => (t, off),
            _ => {
                return Err(self.err(
                    e,
                    format!("{}(OFFSET) is called on key or value", c.func_name),
                ));
            }
        };
        let Some((root, _)) = self.path(target).filter(|(_, s)| s.is_empty()) else {
            return Err(self.err(
                target,
                format!("{} reads the bytes of key, value or values[i]", c.func_name),
            ));
        };
        let offset = match &offset.expr {
            Expr::Literal(LiteralValue::Int(i)) => usize::try_from(*i.inner()).ok(),
            Expr::Literal(LiteralValue::UInt(u)) => usize::try_from(*u.inner()).ok(),
            _ => None,
        }
        .ok_or_else(|| self.err(offset, "the offset is a number of bytes"))?;
        let f = c.func_name.as_str();
        let size = match &f[f.len() - 1..] {
            "8" if f.ends_with("u8") || f.ends_with("i8") => 1,
            "6" => 2,
            "2" => 4,
            _ => 8,
        };
        let len = match root {
            Root::Key => self.layout.key().size(),
            _ => self.layout.value().size(),
        };
        if offset + size > len {
            return Err(self.err(
                e,
                format!(
                    "reads bytes {offset}..{} of a {len}-byte {}",
                    offset + size,
                    if root == Root::Key { "key" } else { "value" }
                ),
            ));
        }
        let load = IntMember::new(
            root,
            IntField::whole(offset, size, f.starts_with('i'), f.starts_with("be")),
        );
        Ok((Node::LoadInt(load), Ty::Int(f.into())))
    }

    fn string_fn(&mut self, e: &IdedExpr, c: &ast::CallExpr) -> Result<Compiled, FilterError> {
        let name = c.func_name.as_str();
        let (target, args): (&IdedExpr, &[IdedExpr]) = match &c.target {
            Some(t) => (t, &c.args),
            None if !c.args.is_empty() => (&c.args[0], &c.args[1..]),
            None => return Err(self.err(e, format!("{name} needs a string"))),
        };
        let (s, ts) = self.node(target)?;
        if !matches!(ts, Ty::Str | Ty::Bytes) {
            return Err(self.err(
                target,
                format!(
                    "is {}: {name}() is for strings (char arrays) and bytes",
                    ts.name()
                ),
            ));
        }
        if name == "size" {
            if !args.is_empty() {
                return Err(self.err(e, "size() takes no argument"));
            }
            return Ok((Node::Size(Box::new(s)), Ty::Int("int".into())));
        }
        let [arg] = args else {
            return Err(self.err(e, format!("{name}() takes one argument")));
        };
        let lit = match &arg.expr {
            Expr::Literal(LiteralValue::String(x)) => x.as_bytes().to_vec(),
            Expr::Literal(LiteralValue::Bytes(x)) => x.to_vec(),
            _ => return Err(self.err(arg, format!("{name}() takes a literal"))),
        };
        if name == "matches" {
            self.regexes += 1;
            if self.regexes > MAX_REGEXES {
                return Err(self.err(
                    e,
                    format!("at most {MAX_REGEXES} regular expressions in a filter"),
                ));
            }
            let text = std::str::from_utf8(&lit)
                .map_err(|_| self.err(arg, "a regular expression is text"))?;
            if text.len() > MAX_REGEX_LEN {
                return Err(self.err(
                    arg,
                    format!("a regular expression is at most {MAX_REGEX_LEN} bytes"),
                ));
            }
            let re = regex::bytes::RegexBuilder::new(text)
                .size_limit(MAX_REGEX_SIZE)
                .dfa_size_limit(MAX_REGEX_SIZE)
                .build()
                .map_err(|err| {
                    self.err(arg, format!("not a regular expression (RE2 syntax): {err}"))
                })?;
            return Ok((Node::Matches(Box::new(s), re), Ty::Bool));
        }
        let f = match name {
            "startsWith" => StrFn::StartsWith,
            "endsWith" => StrFn::EndsWith,
            _ => StrFn::Contains,
        };
        Ok((Node::Str(f, Box::new(s), lit), Ty::Bool))
    }

    fn compare(
        &mut self,
        e: &IdedExpr,
        cmp: Cmp,
        a: &IdedExpr,
        b: &IdedExpr,
    ) -> Result<Compiled, FilterError> {
        // An enum against an enumerator's name.
        if let Some(n) = self.enum_name_compare(e, cmp, a, b)? {
            return Ok((n, Ty::Bool));
        }
        // A rendered member against its rendering's spelling.
        if let Some(n) = self.rendered_compare(e, cmp, a, b)? {
            return Ok((n, Ty::Bool));
        }
        let (na, ta) = self.node(a)?;
        let (nb, tb) = self.node(b)?;
        if !ta.same_kind(&tb) {
            return Err(self.err(
                e,
                format!("cannot compare {} with {}", ta.name(), tb.name()),
            ));
        }
        if matches!(ta, Ty::Bool) && !matches!(cmp, Cmp::Eq | Cmp::Ne) {
            return Err(self.err(e, "bools are compared with == and != only"));
        }
        let node = match (na, nb) {
            (Node::LoadInt(l), Node::Int(k)) => Node::IntCmpConst(l, cmp, k),
            (Node::Int(k), Node::LoadInt(l)) => Node::IntCmpConst(l, flip(cmp), k),
            (na, nb) => Node::Cmp(cmp, Box::new(na), Box::new(nb)),
        };
        Ok((node, Ty::Bool))
    }

    /// `key.daddr == "10.0.0.1"`, `key == 443`: a member the call renders
    /// (ipv4, be16, string, ...) against a literal in that rendering's
    /// spelling, read as the member holds it.
    fn rendered_compare(
        &mut self,
        e: &IdedExpr,
        cmp: Cmp,
        a: &IdedExpr,
        b: &IdedExpr,
    ) -> Result<Option<Node>, FilterError> {
        let literal = |x: &IdedExpr| -> Option<prost_types::Value> {
            match &x.expr {
                Expr::Literal(LiteralValue::String(s)) => Some(s.to_string().into()),
                Expr::Literal(LiteralValue::Int(i)) => Some((*i.inner() as f64).into()),
                Expr::Literal(LiteralValue::UInt(u)) => Some((*u.inner() as f64).into()),
                _ => None,
            }
        };
        let (member, value, cmp) = match (literal(a), literal(b)) {
            (None, Some(v)) => (a, v, cmp),
            (Some(v), None) => (b, v, flip(cmp)),
            _ => return Ok(None),
        };
        let Some((root, steps)) = self.path(member) else {
            return Ok(None);
        };
        let Ok(m) = self.layout.resolve(root, &steps) else {
            return Ok(None);
        };
        let literal = match m.read_rendered(&value) {
            None => return Ok(None),
            // A number against an address or text: the usual rules say why.
            Some(Err(_))
                if !matches!(value.kind, Some(prost_types::value::Kind::StringValue(_))) =>
            {
                return Ok(None);
            }
            Some(Err(err)) => return Err(self.err(e, err)),
            Some(Ok(l)) => l,
        };
        let (loaded, _) = self.node(member)?;
        Ok(Some(match (loaded, literal) {
            (Node::LoadInt(l), Literal::Int(k)) => Node::IntCmpConst(l, cmp, k),
            (loaded, Literal::Bytes(bytes)) => {
                Node::Cmp(cmp, Box::new(loaded), Box::new(Node::Bytes(bytes)))
            }
            (loaded, Literal::Int(k)) => Node::Cmp(cmp, Box::new(loaded), Box::new(Node::Int(k))),
        }))
    }

    /// `key.proto == "IPPROTO_UDP"`: the enumerator's value, or an error
    /// listing the names.
    fn enum_name_compare(
        &mut self,
        e: &IdedExpr,
        cmp: Cmp,
        a: &IdedExpr,
        b: &IdedExpr,
    ) -> Result<Option<Node>, FilterError> {
        let (member, name, flipped) = match (&a.expr, &b.expr) {
            (_, Expr::Literal(LiteralValue::String(s))) => (a, s.to_string(), false),
            (Expr::Literal(LiteralValue::String(s)), _) => (b, s.to_string(), true),
            _ => return Ok(None),
        };
        let Some(values) = self.enum_of(member) else {
            return Ok(None);
        };
        let value = self.enumerator(e, &values, &name)?;
        let (node, _) = self.node(member)?;
        let Node::LoadInt(l) = node else {
            return Ok(None);
        };
        Ok(Some(Node::IntCmpConst(
            l,
            if flipped { flip(cmp) } else { cmp },
            value,
        )))
    }

    /// The enumerators of the enum member `e` names, if it names one.
    fn enum_of(&self, e: &IdedExpr) -> Option<Vec<(String, i64)>> {
        let (root, steps) = self.path(e)?;
        let m = self.layout.resolve(root, &steps).ok()?;
        Some(
            m.enumerators()?
                .iter()
                .map(|(value, name)| (name.clone(), *value))
                .collect(),
        )
    }

    fn enumerator(
        &self,
        e: &IdedExpr,
        values: &[(String, i64)],
        name: &str,
    ) -> Result<i128, FilterError> {
        values
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| i128::from(*v))
            .ok_or_else(|| {
                let names: Vec<&str> = values.iter().map(|(n, _)| n.as_str()).take(16).collect();
                self.err(
                    e,
                    format!(
                        "{name:?} is not an enumerator of the member's enum ({})",
                        names.join(", ")
                    ),
                )
            })
    }

    fn within(
        &mut self,
        e: &IdedExpr,
        item: &IdedExpr,
        list: &IdedExpr,
    ) -> Result<Compiled, FilterError> {
        let Expr::List(l) = &list.expr else {
            return Err(self.err(list, "`in` takes a list literal: x in [1, 2, 3]"));
        };
        self.list_elements += l.elements.len();
        if self.list_elements > MAX_LIST_ELEMENTS {
            return Err(self.err(
                list,
                format!("lists hold at most {MAX_LIST_ELEMENTS} elements in all"),
            ));
        }
        let enums = self.enum_of(item);
        let (n, t) = self.node(item)?;
        match t {
            Ty::Int(_) => {
                let mut set = Vec::with_capacity(l.elements.len());
                for x in &l.elements {
                    let v = match (&x.expr, &enums) {
                        (Expr::Literal(LiteralValue::Int(i)), _) => i128::from(*i.inner()),
                        (Expr::Literal(LiteralValue::UInt(u)), _) => i128::from(*u.inner()),
                        (Expr::Literal(LiteralValue::String(s)), Some(values)) => {
                            self.enumerator(x, values, s)?
                        }
                        _ => {
                            return Err(self.err(
                                x,
                                format!(
                                    "the list holds {}: integer literals only",
                                    "something else"
                                ),
                            ));
                        }
                    };
                    set.push(v);
                }
                let set = Set::new(set);
                Ok((
                    match n {
                        Node::LoadInt(l) => Node::IntInConsts(l, set),
                        n => Node::InInts(Box::new(n), set),
                    },
                    Ty::Bool,
                ))
            }
            Ty::Str | Ty::Bytes => {
                let mut set = Vec::with_capacity(l.elements.len());
                for x in &l.elements {
                    match &x.expr {
                        Expr::Literal(LiteralValue::String(s)) => set.push(s.as_bytes().to_vec()),
                        Expr::Literal(LiteralValue::Bytes(b)) => set.push(b.to_vec()),
                        _ => {
                            return Err(self.err(x, "the list holds string or bytes literals only"));
                        }
                    };
                }
                Ok((Node::InBytes(Box::new(n), Set::new(set)), Ty::Bool))
            }
            other => Err(self.err(
                e,
                format!("`in` is for integers and strings, not {}", other.name()),
            )),
        }
    }
}

/// The values of an `in` list: sorted, without repeats; looked up by a
/// scan when short, by bisection otherwise (no hashing per entry).
#[derive(Debug)]
struct Set<T>(Vec<T>);

/// Lists up to this long are scanned.
const SCAN: usize = 8;

impl<T: Ord> Set<T> {
    fn new(mut values: Vec<T>) -> Self {
        values.sort_unstable();
        values.dedup();
        Self(values)
    }

    #[inline]
    fn contains(&self, x: &T) -> bool {
        if self.0.len() <= SCAN {
            self.0.iter().any(|v| v == x)
        } else {
            self.0.binary_search(x).is_ok()
        }
    }
}

impl Set<Vec<u8>> {
    #[inline]
    fn contains_slice(&self, x: &[u8]) -> bool {
        self.0.binary_search_by(|v| v.as_slice().cmp(x)).is_ok()
    }
}

fn flip(c: Cmp) -> Cmp {
    match c {
        Cmp::Lt => Cmp::Gt,
        Cmp::Le => Cmp::Ge,
        Cmp::Gt => Cmp::Lt,
        Cmp::Ge => Cmp::Le,
        x => x,
    }
}

/// `&&` (`decides` false) or `||` (`decides` true), as CEL has them: the
/// first part that is `decides` decides, whatever errors the others end
/// in; otherwise an error if a part ended in one.
#[inline]
fn join<'a>(parts: &'a [Node], e: &EntryRef<'a>, decides: bool) -> Option<Val<'a>> {
    let mut failed = false;
    for p in parts {
        match eval(p, e) {
            Some(Val::Bool(b)) if b == decides => return Some(Val::Bool(decides)),
            Some(Val::Bool(_)) => {}
            _ => failed = true,
        }
    }
    (!failed).then_some(Val::Bool(!decides))
}

#[inline]
fn eval<'a>(n: &'a Node, e: &EntryRef<'a>) -> Option<Val<'a>> {
    Some(match n {
        Node::IntCmpConst(l, c, k) => Val::Bool(c.test(l.read(e)?, *k)),
        Node::Int(i) => Val::Int(*i),
        Node::Bool(b) => Val::Bool(*b),
        Node::Bytes(b) => Val::Bytes(b),
        Node::LoadInt(l) => Val::Int(l.read(e)?),
        Node::LoadBool(l) => Val::Bool(l.read(e)? != 0),
        Node::LoadBytes(l) => Val::Bytes(l.read(e)?),
        Node::Cmp(c, a, b) => match (eval(a, e)?, eval(b, e)?) {
            (Val::Int(x), Val::Int(y)) => Val::Bool(c.test(x, y)),
            (Val::Bool(x), Val::Bool(y)) => Val::Bool(c.test(x, y)),
            (Val::Bytes(x), Val::Bytes(y)) => Val::Bool(c.test(x, y)),
            _ => return None,
        },
        Node::Arith(op, a, b) => {
            let (Val::Int(x), Val::Int(y)) = (eval(a, e)?, eval(b, e)?) else {
                return None;
            };
            Val::Int(match op {
                Arith::Add => x.checked_add(y)?,
                Arith::Sub => x.checked_sub(y)?,
                Arith::Mul => x.checked_mul(y)?,
                Arith::Div => x.checked_div(y)?,
                Arith::Rem => x.checked_rem(y)?,
            })
        }
        Node::Neg(a) => match eval(a, e)? {
            Val::Int(x) => Val::Int(x.checked_neg()?),
            _ => return None,
        },
        Node::Not(a) => match eval(a, e)? {
            Val::Bool(b) => Val::Bool(!b),
            _ => return None,
        },
        Node::And(parts) => return join(parts, e, false),
        Node::Or(parts) => return join(parts, e, true),
        Node::Cond(c, a, b) => match eval(c, e)? {
            Val::Bool(true) => eval(a, e)?,
            Val::Bool(false) => eval(b, e)?,
            _ => return None,
        },
        Node::IntInConsts(l, set) => Val::Bool(set.contains(&l.read(e)?)),
        Node::InInts(a, set) => match eval(a, e)? {
            Val::Int(x) => Val::Bool(set.contains(&x)),
            _ => return None,
        },
        Node::InBytes(a, set) => match eval(a, e)? {
            Val::Bytes(x) => Val::Bool(set.contains_slice(x)),
            _ => return None,
        },
        Node::Str(f, a, lit) => match eval(a, e)? {
            Val::Bytes(x) => Val::Bool(match f {
                StrFn::StartsWith => x.starts_with(lit),
                StrFn::EndsWith => x.ends_with(lit),
                StrFn::Contains => {
                    lit.is_empty() || x.windows(lit.len()).any(|w| w == lit.as_slice())
                }
            }),
            _ => return None,
        },
        Node::Matches(a, re) => match eval(a, e)? {
            Val::Bytes(x) => Val::Bool(re.is_match(x)),
            _ => return None,
        },
        Node::Size(a) => match eval(a, e)? {
            Val::Bytes(x) => Val::Int(x.len() as i128),
            _ => return None,
        },
    })
}

#[cfg(test)]
#[path = "filter_tests.rs"]
mod tests;
