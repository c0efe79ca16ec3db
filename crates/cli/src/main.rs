fn main() {
    println!("ferrolm");
}
