//! A compiled filter as the condition of a walk inside the kernel: member
//! against constant comparisons (of any width, sign, byte order, and of
//! bitfields), `in` on lists of integers, `&&`, `||`, `!`. What else a
//! filter does stays in user space.

use bpfmap_kernel::program::{CmpOp, Cond};

use super::{Cmp, Filter, Node, flip};
use crate::query::scan::{Sizes, Untranslatable, int_read};

/// Most list elements compared in the kernel.
const MAX_IN: usize = 64;

impl Filter {
    /// The condition of a walk inside the kernel, or why the filter is
    /// evaluated in user space.
    pub(crate) fn kernel_cond(&self, sizes: Sizes) -> Result<Cond, Untranslatable> {
        cond(&self.root, sizes)
    }

    /// A condition for the kernel that takes every entry the filter takes,
    /// and perhaps others (the filter is then tested again in user space):
    /// the filter with what the kernel cannot test left out. The reasons
    /// for what was left out, none when the condition is the filter.
    pub(crate) fn kernel_prefilter(&self, sizes: Sizes) -> (Cond, Vec<Untranslatable>) {
        let mut left_out = Vec::new();
        let c = relaxed(&self.root, sizes, true, &mut left_out).simplified();
        (c, left_out)
    }
}

/// `n` as a condition that takes more entries (`wider`) or fewer than it:
/// what cannot be translated becomes true or false.
fn relaxed(n: &Node, sizes: Sizes, wider: bool, left_out: &mut Vec<Untranslatable>) -> Cond {
    match n {
        Node::Not(x) => Cond::Not(Box::new(relaxed(x, sizes, !wider, left_out))),
        Node::And(xs) => Cond::All(
            xs.iter()
                .map(|x| relaxed(x, sizes, wider, left_out))
                .collect(),
        ),
        Node::Or(xs) => Cond::Any(
            xs.iter()
                .map(|x| relaxed(x, sizes, wider, left_out))
                .collect(),
        ),
        n => cond(n, sizes).unwrap_or_else(|why| {
            if !left_out.contains(&why) {
                left_out.push(why);
            }
            Cond::Const(wider)
        }),
    }
}

fn op(c: Cmp) -> CmpOp {
    match c {
        Cmp::Eq => CmpOp::Eq,
        Cmp::Ne => CmpOp::Ne,
        Cmp::Lt => CmpOp::Lt,
        Cmp::Le => CmpOp::Le,
        Cmp::Gt => CmpOp::Gt,
        Cmp::Ge => CmpOp::Ge,
    }
}

fn cond(n: &Node, sizes: Sizes) -> Result<Cond, Untranslatable> {
    let all = |ns: &[Node]| {
        ns.iter()
            .map(|n| cond(n, sizes))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok(match n {
        Node::Bool(b) => Cond::Const(*b),
        Node::LoadBool(m) => Cond::Cmp(int_read(m, sizes)?, CmpOp::Ne, 0),
        Node::IntCmpConst(m, c, k) => Cond::Cmp(int_read(m, sizes)?, op(*c), *k),
        Node::Cmp(c, a, b) => match (&**a, &**b) {
            (Node::LoadInt(m), Node::Int(k)) => Cond::Cmp(int_read(m, sizes)?, op(*c), *k),
            (Node::Int(k), Node::LoadInt(m)) => Cond::Cmp(int_read(m, sizes)?, op(flip(*c)), *k),
            (Node::LoadBytes(_) | Node::Bytes(_), _) | (_, Node::LoadBytes(_) | Node::Bytes(_)) => {
                return Err(Untranslatable::FilterReadsBytes);
            }
            (Node::Arith(..) | Node::Neg(_), _) | (_, Node::Arith(..) | Node::Neg(_)) => {
                return Err(Untranslatable::FilterComputes);
            }
            _ => return Err(Untranslatable::FilterComparesComputed),
        },
        Node::Not(x) => Cond::Not(Box::new(cond(x, sizes)?)),
        Node::And(xs) => Cond::All(all(xs)?),
        Node::Or(xs) => Cond::Any(all(xs)?),
        Node::IntInConsts(m, set) if set.0.len() <= MAX_IN => {
            let r = int_read(m, sizes)?;
            Cond::Any(set.0.iter().map(|k| Cond::Cmp(r, CmpOp::Eq, *k)).collect())
        }
        Node::InInts(x, set) if set.0.len() <= MAX_IN => match &**x {
            Node::LoadInt(m) => {
                let r = int_read(m, sizes)?;
                Cond::Any(set.0.iter().map(|k| Cond::Cmp(r, CmpOp::Eq, *k)).collect())
            }
            _ => return Err(Untranslatable::FilterListOfComputed),
        },
        Node::IntInConsts(..) | Node::InInts(..) => {
            return Err(Untranslatable::FilterLongList(MAX_IN));
        }
        Node::Arith(..) | Node::Neg(_) => return Err(Untranslatable::FilterComputes),
        Node::Str(..) | Node::Matches(..) | Node::Size(_) | Node::InBytes(..) => {
            return Err(Untranslatable::FilterReadsBytes);
        }
        Node::Cond(..) => return Err(Untranslatable::FilterConditional),
        Node::Int(_) | Node::Bytes(_) | Node::LoadInt(_) | Node::LoadBytes(_) => {
            return Err(Untranslatable::FilterNotCondition);
        }
    })
}
