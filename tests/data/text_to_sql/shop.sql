-- A small shop for the text-to-SQL benchmark and tests (written for splitserve; CC0).
PRAGMA foreign_keys = ON;
CREATE TABLE customers (
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  email TEXT,
  city TEXT NOT NULL,
  country TEXT NOT NULL,
  signup_date DATE NOT NULL
);
CREATE TABLE categories (
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL
);
CREATE TABLE products (
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  category_id INTEGER NOT NULL REFERENCES categories(id),
  price REAL NOT NULL,
  stock INTEGER NOT NULL
);
CREATE TABLE orders (
  id INTEGER PRIMARY KEY,
  customer_id INTEGER NOT NULL REFERENCES customers(id),
  order_date DATE NOT NULL,
  status TEXT NOT NULL
);
CREATE TABLE order_items (
  id INTEGER PRIMARY KEY,
  order_id INTEGER NOT NULL REFERENCES orders(id),
  product_id INTEGER NOT NULL REFERENCES products(id),
  quantity INTEGER NOT NULL,
  unit_price REAL NOT NULL
);
INSERT INTO customers VALUES (1, 'Ana Garcia', 'ana@example.com', 'Lisbon', 'Portugal', '2024-07-25');
INSERT INTO customers VALUES (2, 'Bruno Costa', 'bruno@example.com', 'Porto', 'Portugal', '2024-02-12');
INSERT INTO customers VALUES (3, 'Carla Rossi', 'carla@example.com', 'Berlin', 'Germany', '2024-06-02');
INSERT INTO customers VALUES (4, 'David Weber', NULL, 'Munich', 'Germany', '2024-11-06');
INSERT INTO customers VALUES (5, 'Elena Weber', 'elena@example.com', 'Paris', 'France', '2024-06-11');
INSERT INTO customers VALUES (6, 'Felix Martin', 'felix@example.com', 'Lyon', 'France', '2024-12-11');
INSERT INTO customers VALUES (7, 'Greta Weber', 'greta@example.com', 'Madrid', 'Spain', '2024-12-10');
INSERT INTO customers VALUES (8, 'Hugo Rossi', 'hugo@example.com', 'Rome', 'Italy', '2024-10-13');
INSERT INTO customers VALUES (9, 'Ines Schmidt', 'ines@example.com', 'Lisbon', 'Portugal', '2024-10-03');
INSERT INTO customers VALUES (10, 'Jonas Lopez', 'jonas@example.com', 'Porto', 'Portugal', '2024-08-05');
INSERT INTO customers VALUES (11, 'Karin Garcia', NULL, 'Berlin', 'Germany', '2024-09-08');
INSERT INTO customers VALUES (12, 'Luis Silva', 'luis@example.com', 'Munich', 'Germany', '2024-07-12');
INSERT INTO customers VALUES (13, 'Marta Lopez', 'marta@example.com', 'Paris', 'France', '2024-11-28');
INSERT INTO customers VALUES (14, 'Nils Weber', 'nils@example.com', 'Lyon', 'France', '2024-09-01');
INSERT INTO customers VALUES (15, 'Olga Meyer', 'olga@example.com', 'Madrid', 'Spain', '2024-08-04');
INSERT INTO customers VALUES (16, 'Pedro Martin', 'pedro@example.com', 'Rome', 'Italy', '2024-02-24');
INSERT INTO customers VALUES (17, 'Rita Rossi', 'rita@example.com', 'Berlin', 'Germany', '2024-02-04');
INSERT INTO customers VALUES (18, 'Sven Martin', NULL, 'Madrid', 'Spain', '2024-11-06');
INSERT INTO customers VALUES (19, 'Tomas Rossi', 'tomas@example.com', 'Lyon', 'France', '2024-07-16');
INSERT INTO customers VALUES (20, 'Vera Martin', 'vera@example.com', 'Paris', 'France', '2024-03-14');
INSERT INTO categories VALUES (1, 'Books');
INSERT INTO categories VALUES (2, 'Electronics');
INSERT INTO categories VALUES (3, 'Garden');
INSERT INTO categories VALUES (4, 'Kitchen');
INSERT INTO categories VALUES (5, 'Toys');
INSERT INTO products VALUES (1, 'Paper Notebook', 1, 4.5, 0);
INSERT INTO products VALUES (2, 'Cookbook', 1, 24.0, 16);
INSERT INTO products VALUES (3, 'Travel Guide', 1, 18.5, 44);
INSERT INTO products VALUES (4, 'Novel', 1, 12.99, 44);
INSERT INTO products VALUES (5, 'USB Cable', 2, 7.99, 10);
INSERT INTO products VALUES (6, 'Headphones', 2, 59.0, 44);
INSERT INTO products VALUES (7, 'Keyboard', 2, 45.0, 0);
INSERT INTO products VALUES (8, 'Monitor', 2, 189.0, 23);
INSERT INTO products VALUES (9, 'Garden Hose', 3, 29.9, 5);
INSERT INTO products VALUES (10, 'Seed Pack', 3, 3.5, 15);
INSERT INTO products VALUES (11, 'Shovel', 3, 22.0, 33);
INSERT INTO products VALUES (12, 'Chef Knife', 4, 39.0, 46);
INSERT INTO products VALUES (13, 'Frying Pan', 4, 34.5, 0);
INSERT INTO products VALUES (14, 'Teapot', 4, 19.0, 36);
INSERT INTO products VALUES (15, 'Cutting Board', 4, 15.0, 15);
INSERT INTO products VALUES (16, 'Puzzle', 5, 14.0, 19);
INSERT INTO products VALUES (17, 'Toy Train', 5, 49.0, 47);
INSERT INTO products VALUES (18, 'Board Game', 5, 32.0, 1);
INSERT INTO orders VALUES (1, 5, '2025-07-08', 'delivered');
INSERT INTO order_items VALUES (1, 1, 1, 5, 4.5);
INSERT INTO orders VALUES (2, 12, '2025-10-02', 'delivered');
INSERT INTO order_items VALUES (2, 2, 5, 5, 7.99);
INSERT INTO order_items VALUES (3, 2, 15, 5, 15.0);
INSERT INTO order_items VALUES (4, 2, 3, 1, 18.5);
INSERT INTO order_items VALUES (5, 2, 16, 5, 14.0);
INSERT INTO orders VALUES (3, 15, '2025-01-05', 'shipped');
INSERT INTO order_items VALUES (6, 3, 17, 2, 49.0);
INSERT INTO order_items VALUES (7, 3, 9, 1, 29.9);
INSERT INTO orders VALUES (4, 11, '2025-12-09', 'cancelled');
INSERT INTO order_items VALUES (8, 4, 3, 4, 18.5);
INSERT INTO orders VALUES (5, 18, '2025-11-07', 'delivered');
INSERT INTO order_items VALUES (9, 5, 5, 1, 7.99);
INSERT INTO order_items VALUES (10, 5, 14, 5, 19.0);
INSERT INTO order_items VALUES (11, 5, 6, 3, 59.0);
INSERT INTO orders VALUES (6, 8, '2025-07-02', 'delivered');
INSERT INTO order_items VALUES (12, 6, 18, 4, 32.0);
INSERT INTO orders VALUES (7, 13, '2025-05-23', 'cancelled');
INSERT INTO order_items VALUES (13, 7, 14, 3, 19.0);
INSERT INTO orders VALUES (8, 14, '2025-11-16', 'shipped');
INSERT INTO order_items VALUES (14, 8, 6, 5, 59.0);
INSERT INTO order_items VALUES (15, 8, 7, 1, 45.0);
INSERT INTO order_items VALUES (16, 8, 13, 5, 34.5);
INSERT INTO orders VALUES (9, 11, '2025-10-09', 'delivered');
INSERT INTO order_items VALUES (17, 9, 8, 2, 189.0);
INSERT INTO orders VALUES (10, 10, '2025-02-06', 'pending');
INSERT INTO order_items VALUES (18, 10, 12, 1, 39.0);
INSERT INTO orders VALUES (11, 14, '2025-08-02', 'pending');
INSERT INTO order_items VALUES (19, 11, 16, 5, 14.0);
INSERT INTO order_items VALUES (20, 11, 8, 3, 189.0);
INSERT INTO order_items VALUES (21, 11, 7, 3, 45.0);
INSERT INTO order_items VALUES (22, 11, 4, 1, 12.99);
INSERT INTO orders VALUES (12, 5, '2025-09-19', 'delivered');
INSERT INTO order_items VALUES (23, 12, 4, 5, 12.99);
INSERT INTO order_items VALUES (24, 12, 2, 4, 24.0);
INSERT INTO order_items VALUES (25, 12, 17, 3, 49.0);
INSERT INTO orders VALUES (13, 9, '2025-06-09', 'cancelled');
INSERT INTO order_items VALUES (26, 13, 4, 5, 12.99);
INSERT INTO order_items VALUES (27, 13, 14, 4, 19.0);
INSERT INTO order_items VALUES (28, 13, 17, 2, 49.0);
INSERT INTO order_items VALUES (29, 13, 8, 2, 189.0);
INSERT INTO orders VALUES (14, 12, '2025-09-28', 'delivered');
INSERT INTO order_items VALUES (30, 14, 9, 4, 29.9);
INSERT INTO order_items VALUES (31, 14, 18, 1, 32.0);
INSERT INTO order_items VALUES (32, 14, 17, 1, 49.0);
INSERT INTO order_items VALUES (33, 14, 4, 3, 12.99);
INSERT INTO orders VALUES (15, 16, '2025-10-10', 'delivered');
INSERT INTO order_items VALUES (34, 15, 17, 1, 49.0);
INSERT INTO order_items VALUES (35, 15, 10, 1, 3.5);
INSERT INTO orders VALUES (16, 1, '2025-04-17', 'delivered');
INSERT INTO order_items VALUES (36, 16, 4, 1, 12.99);
INSERT INTO order_items VALUES (37, 16, 5, 3, 7.99);
INSERT INTO order_items VALUES (38, 16, 16, 1, 14.0);
INSERT INTO orders VALUES (17, 3, '2025-09-22', 'shipped');
INSERT INTO order_items VALUES (39, 17, 14, 2, 19.0);
INSERT INTO order_items VALUES (40, 17, 2, 2, 24.0);
INSERT INTO orders VALUES (18, 6, '2025-06-26', 'cancelled');
INSERT INTO order_items VALUES (41, 18, 7, 4, 45.0);
INSERT INTO order_items VALUES (42, 18, 4, 1, 12.99);
INSERT INTO order_items VALUES (43, 18, 6, 5, 59.0);
INSERT INTO order_items VALUES (44, 18, 5, 5, 7.99);
INSERT INTO orders VALUES (19, 15, '2025-12-17', 'delivered');
INSERT INTO order_items VALUES (45, 19, 17, 3, 49.0);
INSERT INTO order_items VALUES (46, 19, 9, 4, 29.9);
INSERT INTO order_items VALUES (47, 19, 5, 1, 7.99);
INSERT INTO order_items VALUES (48, 19, 1, 5, 4.5);
INSERT INTO orders VALUES (20, 6, '2025-10-21', 'pending');
INSERT INTO order_items VALUES (49, 20, 9, 3, 29.9);
INSERT INTO orders VALUES (21, 17, '2025-01-01', 'delivered');
INSERT INTO order_items VALUES (50, 21, 3, 4, 18.5);
INSERT INTO orders VALUES (22, 13, '2025-03-20', 'shipped');
INSERT INTO order_items VALUES (51, 22, 10, 2, 3.5);
INSERT INTO orders VALUES (23, 7, '2025-10-06', 'pending');
INSERT INTO order_items VALUES (52, 23, 17, 5, 49.0);
INSERT INTO order_items VALUES (53, 23, 8, 1, 189.0);
INSERT INTO order_items VALUES (54, 23, 13, 1, 34.5);
INSERT INTO orders VALUES (24, 3, '2025-05-11', 'shipped');
INSERT INTO order_items VALUES (55, 24, 6, 5, 59.0);
INSERT INTO order_items VALUES (56, 24, 10, 3, 3.5);
INSERT INTO orders VALUES (25, 10, '2025-09-01', 'delivered');
INSERT INTO order_items VALUES (57, 25, 8, 1, 189.0);
INSERT INTO order_items VALUES (58, 25, 4, 1, 12.99);
INSERT INTO orders VALUES (26, 11, '2025-03-05', 'delivered');
INSERT INTO order_items VALUES (59, 26, 12, 5, 39.0);
INSERT INTO order_items VALUES (60, 26, 1, 2, 4.5);
INSERT INTO order_items VALUES (61, 26, 5, 2, 7.99);
INSERT INTO orders VALUES (27, 5, '2025-09-02', 'shipped');
INSERT INTO order_items VALUES (62, 27, 1, 4, 4.5);
INSERT INTO order_items VALUES (63, 27, 18, 3, 32.0);
INSERT INTO order_items VALUES (64, 27, 2, 4, 24.0);
INSERT INTO orders VALUES (28, 6, '2025-08-25', 'delivered');
INSERT INTO order_items VALUES (65, 28, 16, 4, 14.0);
INSERT INTO order_items VALUES (66, 28, 10, 2, 3.5);
INSERT INTO orders VALUES (29, 4, '2025-07-13', 'cancelled');
INSERT INTO order_items VALUES (67, 29, 6, 1, 59.0);
INSERT INTO orders VALUES (30, 18, '2025-04-02', 'delivered');
INSERT INTO order_items VALUES (68, 30, 1, 2, 4.5);
INSERT INTO orders VALUES (31, 11, '2025-10-08', 'pending');
INSERT INTO order_items VALUES (69, 31, 15, 4, 15.0);
INSERT INTO order_items VALUES (70, 31, 16, 4, 14.0);
INSERT INTO order_items VALUES (71, 31, 4, 2, 12.99);
INSERT INTO orders VALUES (32, 14, '2025-11-19', 'pending');
INSERT INTO order_items VALUES (72, 32, 3, 2, 18.5);
INSERT INTO orders VALUES (33, 4, '2025-09-08', 'cancelled');
INSERT INTO order_items VALUES (73, 33, 17, 5, 49.0);
INSERT INTO order_items VALUES (74, 33, 2, 3, 24.0);
INSERT INTO order_items VALUES (75, 33, 14, 4, 19.0);
INSERT INTO order_items VALUES (76, 33, 1, 3, 4.5);
INSERT INTO orders VALUES (34, 15, '2025-01-04', 'delivered');
INSERT INTO order_items VALUES (77, 34, 14, 3, 19.0);
INSERT INTO order_items VALUES (78, 34, 12, 1, 39.0);
INSERT INTO orders VALUES (35, 11, '2025-05-22', 'delivered');
INSERT INTO order_items VALUES (79, 35, 1, 1, 4.5);
INSERT INTO order_items VALUES (80, 35, 18, 1, 32.0);
INSERT INTO order_items VALUES (81, 35, 10, 4, 3.5);
INSERT INTO order_items VALUES (82, 35, 5, 1, 7.99);
INSERT INTO orders VALUES (36, 10, '2025-07-11', 'delivered');
INSERT INTO order_items VALUES (83, 36, 17, 2, 49.0);
INSERT INTO order_items VALUES (84, 36, 13, 3, 34.5);
INSERT INTO orders VALUES (37, 12, '2025-11-28', 'cancelled');
INSERT INTO order_items VALUES (85, 37, 5, 5, 7.99);
INSERT INTO order_items VALUES (86, 37, 18, 2, 32.0);
INSERT INTO order_items VALUES (87, 37, 7, 5, 45.0);
INSERT INTO order_items VALUES (88, 37, 4, 1, 12.99);
INSERT INTO orders VALUES (38, 4, '2025-04-10', 'delivered');
INSERT INTO order_items VALUES (89, 38, 13, 1, 34.5);
INSERT INTO order_items VALUES (90, 38, 8, 5, 189.0);
INSERT INTO order_items VALUES (91, 38, 17, 1, 49.0);
INSERT INTO order_items VALUES (92, 38, 6, 4, 59.0);
INSERT INTO orders VALUES (39, 6, '2025-01-19', 'delivered');
INSERT INTO order_items VALUES (93, 39, 2, 4, 24.0);
INSERT INTO orders VALUES (40, 15, '2025-02-12', 'cancelled');
INSERT INTO order_items VALUES (94, 40, 12, 4, 39.0);
INSERT INTO order_items VALUES (95, 40, 16, 5, 14.0);
INSERT INTO order_items VALUES (96, 40, 6, 2, 59.0);
INSERT INTO order_items VALUES (97, 40, 13, 5, 34.5);
INSERT INTO orders VALUES (41, 13, '2025-10-17', 'pending');
INSERT INTO order_items VALUES (98, 41, 6, 2, 59.0);
INSERT INTO order_items VALUES (99, 41, 12, 4, 39.0);
INSERT INTO order_items VALUES (100, 41, 2, 1, 24.0);
INSERT INTO order_items VALUES (101, 41, 18, 4, 32.0);
INSERT INTO orders VALUES (42, 4, '2025-07-21', 'delivered');
INSERT INTO order_items VALUES (102, 42, 13, 1, 34.5);
INSERT INTO order_items VALUES (103, 42, 1, 1, 4.5);
INSERT INTO order_items VALUES (104, 42, 14, 1, 19.0);
INSERT INTO order_items VALUES (105, 42, 3, 3, 18.5);
INSERT INTO orders VALUES (43, 9, '2025-12-23', 'delivered');
INSERT INTO order_items VALUES (106, 43, 12, 3, 39.0);
INSERT INTO order_items VALUES (107, 43, 15, 5, 15.0);
INSERT INTO order_items VALUES (108, 43, 14, 4, 19.0);
INSERT INTO order_items VALUES (109, 43, 13, 2, 34.5);
INSERT INTO orders VALUES (44, 17, '2025-11-18', 'delivered');
INSERT INTO order_items VALUES (110, 44, 7, 3, 45.0);
INSERT INTO order_items VALUES (111, 44, 10, 2, 3.5);
INSERT INTO orders VALUES (45, 6, '2025-07-18', 'delivered');
INSERT INTO order_items VALUES (112, 45, 18, 4, 32.0);
INSERT INTO orders VALUES (46, 16, '2025-06-17', 'delivered');
INSERT INTO order_items VALUES (113, 46, 8, 3, 189.0);
INSERT INTO order_items VALUES (114, 46, 16, 2, 14.0);
INSERT INTO order_items VALUES (115, 46, 10, 3, 3.5);
INSERT INTO orders VALUES (47, 3, '2025-08-17', 'shipped');
INSERT INTO order_items VALUES (116, 47, 2, 4, 24.0);
INSERT INTO order_items VALUES (117, 47, 6, 3, 59.0);
INSERT INTO orders VALUES (48, 5, '2025-07-20', 'shipped');
INSERT INTO order_items VALUES (118, 48, 12, 2, 39.0);
INSERT INTO order_items VALUES (119, 48, 1, 4, 4.5);
INSERT INTO order_items VALUES (120, 48, 2, 1, 24.0);
