//! Types that carry a const generic's value, so that `#[oom_retry]` can name a generic
//! instance with `core::any::type_name` (`ConstUsize<4>` is not `ConstUsize<8>`): plans are
//! remembered per instance.

macro_rules! const_keys {
    ($($name:ident: $ty:ty),* $(,)?) => {$(
        #[doc = concat!("The value of a `const N: ", stringify!($ty), "` in a type's name.")]
        pub struct $name<const N: $ty>;
    )*};
}

const_keys!(
    ConstU8: u8,
    ConstU16: u16,
    ConstU32: u32,
    ConstU64: u64,
    ConstU128: u128,
    ConstUsize: usize,
    ConstI8: i8,
    ConstI16: i16,
    ConstI32: i32,
    ConstI64: i64,
    ConstI128: i128,
    ConstIsize: isize,
    ConstBool: bool,
    ConstChar: char,
);
