//! Element types and reduction operations, shared by memory views, the wire header and
//! the reduction kernels.

use crate::error::{invalid, Result};
use half::{bf16, f16};

/// Element type of a buffer. The discriminants are the C ABI's and the wire format's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE 754 single precision (`float32`).
    F32 = 0,
    /// IEEE 754 double precision (`float64`).
    F64 = 1,
    /// IEEE 754 half precision (`float16`).
    F16 = 2,
    /// bfloat16: single precision's exponent with an 8-bit significand (`bfloat16`).
    BF16 = 3,
    /// Signed 8-bit integer (`int8`).
    I8 = 4,
    /// Unsigned 8-bit integer (`uint8`).
    U8 = 5,
    /// Signed 32-bit integer (`int32`).
    I32 = 6,
    /// Signed 64-bit integer (`int64`).
    I64 = 7,
    /// One byte, 0 false and anything else true (as C's and torch's `bool`).
    Bool = 8,
}

impl DType {
    /// Every type, indexed by its discriminant (so `ALL[code]` decodes a wire/C value).
    pub const ALL: [DType; 9] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I8, DType::U8, DType::I32, DType::I64, DType::Bool];
    /// The floating-point types (the ones `avg` is defined for).
    pub const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Short name as used by the CLI and in messages (torch's names).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        Self::FLOATS.contains(&self)
    }

    /// Decodes a wire/C value.
    pub fn from_u8(v: u8) -> Result<Self> {
        Self::ALL.get(v as usize).copied().ok_or_else(|| invalid(format!("unknown dtype code {v}")))
    }

    /// Machine epsilon: the unit of relative error for one rounding in this type (0 for the
    /// integer types, whose results are exact).
    pub fn epsilon(self) -> f64 {
        match self {
            DType::F32 => f32::EPSILON as f64,
            DType::F64 => f64::EPSILON,
            DType::F16 => f16::EPSILON.to_f64(),
            DType::BF16 => bf16::EPSILON.to_f64(),
            DType::I8 | DType::U8 | DType::I32 | DType::I64 | DType::Bool => 0.0,
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "float32" | "f32" | "float" => Ok(DType::F32),
            "float64" | "f64" | "double" => Ok(DType::F64),
            "float16" | "f16" | "half" => Ok(DType::F16),
            "bfloat16" | "bf16" => Ok(DType::BF16),
            "int8" | "i8" => Ok(DType::I8),
            "uint8" | "u8" => Ok(DType::U8),
            "int32" | "i32" | "int" => Ok(DType::I32),
            "int64" | "i64" | "long" => Ok(DType::I64),
            "bool" => Ok(DType::Bool),
            _ => Err(format!("unknown dtype {s:?} (float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool)")),
        }
    }
}

/// Reduction operation. The discriminants are the C ABI's and the wire format's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum = 0,
    /// Elementwise sum divided by the number of ranks (floating-point types only).
    Avg = 1,
    /// Elementwise minimum.
    Min = 2,
    /// Elementwise maximum.
    Max = 3,
    /// Integers wrap on overflow, as in C and torch; on `bool`, sum and max are a logical
    /// or, product and min a logical and.
    Product = 4,
}

impl ReduceOp {
    /// Every operation, indexed by its discriminant (so `ALL[code]` decodes a wire/C value).
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product];

    /// Short name as used by the CLI and in messages.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
        }
    }

    /// Decodes a wire/C value.
    pub fn from_u8(v: u8) -> Result<Self> {
        Self::ALL.get(v as usize).copied().ok_or_else(|| invalid(format!("unknown reduce op code {v}")))
    }

    /// Whether this operation is defined on `dtype`: everything is, except `avg` on the
    /// integer and bool types (an average is not an integer).
    pub fn check(self, dtype: DType) -> Result<()> {
        if self == ReduceOp::Avg && !dtype.is_float() {
            return Err(invalid(format!("op avg needs a floating-point dtype, not {} (reduce with sum, then divide)", dtype.name())));
        }
        Ok(())
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "sum" => Ok(ReduceOp::Sum),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            "product" | "prod" => Ok(ReduceOp::Product),
            _ => Err(format!("unknown op {s:?} (sum, avg, min, max, product)")),
        }
    }
}

/// A Rust element type gradwire can reduce. Sealed to the wire types (`bool` excepted: a
/// reduced byte need not be 0 or 1, which a Rust `bool` must be).
pub trait Element: Copy + Send + Sync + 'static + private::Sealed {
    /// The wire type of this Rust type.
    const DTYPE: DType;
    /// Converts to `f64` (exact for every float type; for integers up to 2^53).
    fn to_f64(self) -> f64;
    /// Converts from `f64` with Rust's `as` semantics (rounding for floats, truncating and
    /// saturating for integers).
    fn from_f64(v: f64) -> Self;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i8 {}
    impl Sealed for u8 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
}

macro_rules! integer_element {
    ($($t:ty => $d:ident),*) => {$(
        /// `to_f64` is exact up to 2^53; `from_f64` truncates and saturates.
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    )*};
}
integer_element!(i8 => I8, u8 => U8, i32 => I32, i64 => I64);
